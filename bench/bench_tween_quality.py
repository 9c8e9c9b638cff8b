"""Measure the promises of Neural Tweening (the Tweening document), instead of repeating them. Not in CI.

    python bench/bench_tween_quality.py                  # everything (about 10 min on 1 busy CPU thread); prints the tables
    python bench/bench_tween_quality.py --out t.md       # ... and writes them to t.md (copied into bench/RESULTS.md)
    python bench/bench_tween_quality.py --parts faults   # only some parts: accuracy faults switch aggressive
    python bench/bench_tween_quality.py --quick          # a smoke run (1 seed, tiny sizes), nothing written

The promises, each reported as met or not met with its numbers:

1. **No false alarms** (part ``accuracy``): ordinary training at default settings — digits 64-32-10 and
   Fashion-MNIST 784-256-10, batch 1 and batch 32, several epochs — detects no explosion.
2. **Real explosions are caught fast** (part ``faults``): after an injected fault (one layer's weights
   ×50, or the learning rate ×K for 3 steps) detection fires within 3 steps, and the training loss
   returns below its pre-fault level sooner than with SGD+momentum.
3. **Task switches never freeze or collapse learning** (part ``switch``): online (batch 1) digits, labels
   permuted mid-stream; Tween reaches 80 % of its pre-switch accuracy at least as fast as SGD+momentum
   and ends on the new task within 2 points of it.
4. **Aggressive settings stay stable** (part ``aggressive``): at a learning rate where SGD+momentum
   diverges (NaN or chance accuracy), Tween with detection converges.
5. **Accuracy** (part ``accuracy``): Tween ≥ backprop (SGD+momentum at the same rate) − 1 point.

Methods: ``Tween`` = ``TweenConfig(base_rate=lr)`` (the document's other defaults); ``Tween (no det.)`` =
the same with ``explosion_detection=False``; ``SGD+mom`` = ``torch.optim.SGD(lr, momentum=0.9)`` (Tween's
rate and momentum); ``AdamW`` = ``torch.optim.AdamW(lr=1e-3)``. Baselines train with plain autograd on
``F.cross_entropy`` (torchloom's layers, torch's optimizers). Fashion-MNIST is read from the Debian package
``dataset-fashion-mnist`` (``/usr/share/datasets/fashion-mnist``); nothing is downloaded, and the script
stops with a clear message when the package is absent.
"""

from __future__ import annotations

import argparse
import datetime
import gzip
import math
import platform
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from torchloom.layers.dense import Dense  # noqa: E402
from torchloom.layers.network import Network  # noqa: E402
from torchloom.methods.tween import TweenConfig, TweenState  # noqa: E402

FASHION_DIR = Path("/usr/share/datasets/fashion-mnist")
FASHION_FILES = ("train-images-idx3-ubyte.gz", "train-labels-idx1-ubyte.gz", "t10k-images-idx3-ubyte.gz", "t10k-labels-idx1-ubyte.gz")
RATE = 0.01  # Tween's base_rate and SGD's lr
ADAMW_LR = 1e-3


# ------------------------------------------------------------------------------------- data
def load_digits_split():
    """scikit-learn digits: 1347 train / 450 test (stratified, random_state 0), inputs / 16."""
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    d = load_digits()
    xtr, xte, ytr, yte = train_test_split(d.data / 16.0, d.target, test_size=0.25, random_state=0, stratify=d.target)
    f = lambda a: torch.tensor(a, dtype=torch.float32)
    return f(xtr), torch.tensor(ytr), f(xte), torch.tensor(yte)


def fashion_available() -> bool:
    return all((FASHION_DIR / n).is_file() for n in FASHION_FILES)


def load_fashion():
    """Fashion-MNIST from the Debian package's files (inputs / 255); ``SystemExit`` with a clear message
    when the package is not installed (this benchmark never downloads)."""
    if not fashion_available():
        missing = [n for n in FASHION_FILES if not (FASHION_DIR / n).is_file()]
        raise SystemExit(
            f"Fashion-MNIST files not found in {FASHION_DIR} (missing {', '.join(missing)}). Install the Debian "
            "package dataset-fashion-mnist (apt-get install dataset-fashion-mnist); this benchmark never downloads."
        )

    def read(name, offset):
        with gzip.open(FASHION_DIR / name) as f:
            return np.frombuffer(f.read(), np.uint8, offset=offset)

    xtr = torch.tensor(read(FASHION_FILES[0], 16).reshape(-1, 784) / 255.0, dtype=torch.float32)
    xte = torch.tensor(read(FASHION_FILES[2], 16).reshape(-1, 784) / 255.0, dtype=torch.float32)
    ytr = torch.tensor(read(FASHION_FILES[1], 8).astype(np.int64))
    yte = torch.tensor(read(FASHION_FILES[3], 8).astype(np.int64))
    return xtr, ytr, xte, yte


# ---------------------------------------------------------------------------------- methods
class TweenMethod:
    def __init__(self, net: Network, lr: float = RATE, detection: bool = True):
        self.net, self.lr = net, lr
        self.state = TweenState(net, TweenConfig(base_rate=lr, explosion_detection=detection))

    def step(self, x, y, mult: float = 1.0):
        """One step; ``mult`` ≠ 1 is a learning-rate fault: this step runs at ``mult × lr``."""
        if mult != 1.0:
            self.state.adaptive_rate = self.lr * mult
            return self.state.step(self.net, x, y, rate=self.lr * mult)
        return self.state.step(self.net, x, y)

    @property
    def explosions(self):
        return self.state.explosion_count


class TorchMethod:
    def __init__(self, net: Network, opt_cls, lr: float, **kw):
        self.net, self.lr = net, lr
        self.opt = opt_cls(net.parameters(), lr=lr, **kw)

    def step(self, x, y, mult: float = 1.0):
        for g in self.opt.param_groups:
            g["lr"] = self.lr * mult
        self.opt.zero_grad(set_to_none=True)
        loss = F.cross_entropy(self.net(x), y)
        loss.backward()
        self.opt.step()
        return loss

    explosions = None


def make_method(name: str, net: Network, lr: float = RATE):
    if name == "Tween":
        return TweenMethod(net, lr)
    if name == "Tween (no det.)":
        return TweenMethod(net, lr, detection=False)
    if name == "SGD+mom":
        return TorchMethod(net, torch.optim.SGD, lr, momentum=0.9)
    if name == "AdamW":
        return TorchMethod(net, torch.optim.AdamW, ADAMW_LR if lr == RATE else lr)
    raise ValueError(name)


def make_net(sizes, seed):
    torch.manual_seed(seed)
    layers = [Dense(a, b, "relu") for a, b in zip(sizes[:-2], sizes[1:-1])] + [Dense(sizes[-2], sizes[-1])]
    return Network(*layers)


@torch.no_grad()
def accuracy(net, x, y, chunk=4096):
    correct = sum(int((net(x[i : i + chunk]).argmax(1) == y[i : i + chunk]).sum()) for i in range(0, len(y), chunk))
    return correct / len(y)


@torch.no_grad()
def full_loss(net, x, y):
    return float(F.cross_entropy(net(x), y))


def mean_std(values, fmt="{:.2f}", scale=1.0):
    vals = [v * scale for v in values]
    if len(vals) == 1:
        return fmt.format(vals[0])
    return f"{fmt.format(statistics.mean(vals))} ± {fmt.format(statistics.stdev(vals))}"


def met(flag: bool) -> str:
    return "**met**" if flag else "**not met**"


# ----------------------------------------------------------------- 1 + 5: accuracy, false alarms
def run_accuracy(data, sizes, epochs, batch, seeds, methods):
    xtr, ytr, xte, yte = data
    rows = {}
    for name in methods:
        accs, times, expl, growth = [], [], [], []
        for seed in seeds:
            net = make_net(sizes, seed)
            m = make_method(name, net)
            g = torch.Generator().manual_seed(1000 + seed)
            t0 = time.perf_counter()
            for _ in range(epochs):
                perm = torch.randperm(len(ytr), generator=g)
                for i in range(0, len(perm), batch):
                    idx = perm[i : i + batch]
                    m.step(xtr[idx], ytr[idx])
                    if isinstance(m, TweenMethod) and m.state.steps > 10:
                        growth.append(m.state.gap_growth_rate)
            times.append(time.perf_counter() - t0)
            accs.append(accuracy(net, xte, yte))
            if isinstance(m, TweenMethod):
                expl.append(m.state.explosion_count)
            print(f"    {name:<16} batch {batch:>2} seed {seed}: test acc {accs[-1]:.4f} ({times[-1]:.1f}s)"
                  + (f", explosions {expl[-1]}" if expl else ""), flush=True)
        rows[name] = dict(acc=accs, time=times, explosions=expl, max_growth=max(growth) if growth else None)
    return rows


# ------------------------------------------------------------------------------- 2: faults
FAULTS = {
    "last layer weights ×50": dict(layer=-1, factor=50.0),
    "first layer weights ×50": dict(layer=0, factor=50.0),
    "lr ×1000 for 3 steps": dict(lr_mult=1000.0, lr_steps=3),
    "lr ×100 for 3 steps": dict(lr_mult=100.0, lr_steps=3),
}


def run_fault(data, fault, pre_epochs, post_epochs, batch, seeds, methods):
    """Train ``pre_epochs`` on digits, inject ``fault``, train ``post_epochs`` more; the whole training
    set's loss after every step. Returns per method the per-seed results."""
    xtr, ytr, xte, yte = data
    out = {}
    for name in methods:
        per_seed = []
        for seed in seeds:
            net = make_net((64, 32, 10), seed)
            m = make_method(name, net)
            g = torch.Generator().manual_seed(3000 + seed)
            batches = lambda: [torch.randperm(len(ytr), generator=g)[i : i + batch] for i in range(0, len(ytr), batch)]
            for _ in range(pre_epochs):
                for idx in batches():
                    m.step(xtr[idx], ytr[idx])
            pre, acc_pre = full_loss(net, xtr, ytr), accuracy(net, xte, yte)
            e0 = m.explosions
            if "layer" in fault:
                with torch.no_grad():
                    net.layers[fault["layer"]].weight.mul_(fault["factor"])
            steps, recovered, detected, peak, growth, active = 0, None, None, pre, [], None
            for _ in range(post_epochs):
                for idx in batches():
                    mult = fault.get("lr_mult", 1.0) if steps < fault.get("lr_steps", 0) else 1.0
                    m.step(xtr[idx], ytr[idx], mult)
                    steps += 1
                    cur = full_loss(net, xtr, ytr)
                    peak = max(peak, cur) if math.isfinite(cur) else math.inf
                    if recovered is None and cur <= pre:
                        recovered = steps
                    if isinstance(m, TweenMethod):
                        if active is None and m.state.active is not None and bool(m.state.active.any()):
                            active = steps  # the first step in which some sample contributes a gradient
                        if steps <= 5:
                            growth.append(m.state.gap_growth_rate)
                        if detected is None and m.state.explosion_count > e0:
                            detected = steps
            final = full_loss(net, xtr, ytr)
            res = dict(pre=pre, peak=peak, recovered=recovered, steps=steps, final=final, acc_pre=acc_pre,
                       acc=accuracy(net, xte, yte), detected=detected, active=active,
                       explosions=(m.explosions - e0) if isinstance(m, TweenMethod) else None,
                       rate_end=m.state.adaptive_rate if isinstance(m, TweenMethod) else None,
                       growth5=max(growth) if growth else None)
            per_seed.append(res)
            print(f"    {name:<16} seed {seed}: pre {pre:.3f} peak {peak:.3g} recovered {recovered} detected {detected} (first active {active}) "
                  f"final {final:.3f} acc {acc_pre:.3f}->{res['acc']:.3f}", flush=True)
        out[name] = per_seed
    return out


# --------------------------------------------------------------------------- 3: task switch
def run_switch(data, phase_a, phase_b, window, seeds, methods):
    """Online test-then-train (batch 1) on the digits training split: ``phase_a`` samples of task A, then
    ``phase_b`` samples with the labels permuted (a fixed derangement). Accuracy in windows of
    ``window`` samples; the end accuracy is on the held-out test split under the new labels."""
    xtr, ytr, xte, yte = data
    perm_labels = torch.tensor([3, 7, 5, 9, 0, 2, 8, 1, 4, 6])  # no label keeps its class
    out = {}
    for name in methods:
        per_seed = []
        for seed in seeds:
            net = make_net((64, 32, 10), seed)
            m = make_method(name, net)
            g = torch.Generator().manual_seed(2000 + seed)
            order = torch.cat([torch.randperm(len(ytr), generator=g) for _ in range((phase_a + phase_b) // len(ytr) + 1)])
            windows, hits, rate_min = [], 0, math.inf
            for j in range(phase_a + phase_b):
                k = int(order[j])
                x, y = xtr[k : k + 1], ytr[k : k + 1]
                if j >= phase_a:
                    y = perm_labels[y]
                with torch.no_grad():
                    hits += int(net(x).argmax(1).item() == y.item())  # test ...
                m.step(x, y)  # ... then train
                if isinstance(m, TweenMethod) and j >= phase_a:
                    rate_min = min(rate_min, m.state.adaptive_rate)
                if (j + 1) % window == 0:
                    windows.append(hits / window)
                    hits = 0
            na = phase_a // window
            pre = statistics.mean(windows[na - 3 : na])  # the last 300 samples before the switch
            after = windows[na:]
            back = next((w for w, a in enumerate(after) if a >= 0.8 * pre), None)
            res = dict(pre=pre, low=min(after), rec=(back + 1) * window if back is not None else math.inf,
                       end=accuracy(net, xte, perm_labels[yte]), windows=windows,
                       explosions=m.explosions, rate_min=rate_min if isinstance(m, TweenMethod) else None)
            per_seed.append(res)
            print(f"    {name:<16} seed {seed}: pre {pre:.3f} lowest {res['low']:.2f} to-80% {res['rec']} end {res['end']:.3f}"
                  + (f" explosions {res['explosions']} min rate {rate_min:.2g}" if isinstance(m, TweenMethod) else ""), flush=True)
        out[name] = per_seed
    return out


# ---------------------------------------------------------------------------- 4: aggressive
def run_aggressive(data, lrs, epochs, batch, seeds, methods):
    xtr, ytr, xte, yte = data
    out = {}
    for lr in lrs:
        for name in methods:
            res = []
            for seed in seeds:
                net = make_net((64, 32, 10), seed)
                m = make_method(name, net, lr)
                g = torch.Generator().manual_seed(4000 + seed)
                growth = []
                for _ in range(epochs):
                    perm = torch.randperm(len(ytr), generator=g)
                    for i in range(0, len(perm), batch):
                        idx = perm[i : i + batch]
                        m.step(xtr[idx], ytr[idx])
                        if isinstance(m, TweenMethod) and m.state.steps > 10:
                            growth.append(m.state.gap_growth_rate)
                finite = all(bool(torch.isfinite(p).all()) for p in net.parameters())
                acc = accuracy(net, xte, yte) if finite else 0.0
                res.append(dict(acc=acc, finite=finite, explosions=m.explosions, growth=max(growth) if growth else None))
                print(f"    lr {lr:<5} {name:<16} seed {seed}: test acc {acc:.3f} finite {finite}"
                      + (f" explosions {m.explosions}" if m.explosions is not None else ""), flush=True)
            out[(lr, name)] = res
    return out


def diverged(r):
    """NaN/Inf weights or chance-level accuracy (≤ 20 % on 10 balanced classes)."""
    return (not r["finite"]) or r["acc"] <= 0.2


# --------------------------------------------------------------------------------- reporting
def fmt_detect(rows):
    """Detection steps per seed: after the fault (after the first step with a gradient)."""
    return ", ".join("never" if x["detected"] is None else f"{x['detected']} ({x['detected'] - x['active'] + 1})" for x in rows)


def fmt_steps(values, total):
    done = [v for v in values if v is not None and v != math.inf]
    if not done:
        return f"never (in {total})"
    s = mean_std(done, "{:.0f}")
    return s if len(done) == len(values) else f"{s} ({len(done)}/{len(values)} seeds; rest never in {total})"


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parts_all = ["accuracy", "faults", "switch", "aggressive"]
    ap.add_argument("--parts", nargs="+", default=parts_all, choices=parts_all)
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--fashion-train", type=int, default=10000, help="Fashion-MNIST training samples used at batch 32 (the first N)")
    ap.add_argument("--fashion-online", type=int, default=5000, help="Fashion-MNIST training samples used at batch 1 (the first N)")
    ap.add_argument("--quick", action="store_true", help="1 seed, tiny sizes: a smoke run; nothing written")
    ap.add_argument("--out", default=None, help="also write the tables to this markdown file")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)  # small networks; the machine's cores are shared
    q = args.quick
    seeds = list(range(1 if q else args.seeds))
    cmd = "python bench/bench_tween_quality.py " + " ".join(argv if argv is not None else sys.argv[1:])
    t_start = time.perf_counter()
    md = [
        "# Neural Tweening: measured promises",
        "",
        f"Date: {datetime.date.today()}. Machine: CPU ({platform.processor() or platform.machine()}, shared with other jobs), "
        f"torch {torch.__version__}, 1 thread. Command: `{cmd.strip()}`.",
        "",
        f"Methods: **Tween** = `TweenConfig(base_rate=lr)` with the other defaults (momentum 0.9, link_budget_scale 1, "
        "gap_threshold 0.1, explosion_limit 10, recovery_rate 0.5, recovery_growth 1.05, depth scaling, detection on); "
        "**Tween (no det.)** = the same with `explosion_detection=False`; **SGD+mom** = `torch.optim.SGD(lr, momentum=0.9)`; "
        f"**AdamW** = `torch.optim.AdamW(lr={ADAMW_LR})`. lr = {RATE} unless stated. Softmax cross-entropy, ReLU hidden "
        f"layer, torchloom `Dense` layers (default init), seeds {seeds} (init and data order), mean ± std over seeds.",
        "",
    ]
    verdicts = []
    digits = load_digits_split()

    if "accuracy" in args.parts:
        d_ep = {1: 1 if q else 5, 32: 2 if q else 30}
        f_ep = {1: 1, 32: 1 if q else 10}
        ftrain = {1: 1000 if q else args.fashion_online, 32: 2000 if q else args.fashion_train}
        xtr, ytr, xte, yte = load_fashion()
        methods = ["Tween", "SGD+mom", "AdamW"]
        res = {}
        for ds, sizes, ep in (("digits", (64, 32, 10), d_ep), ("Fashion-MNIST", (784, 256, 10), f_ep)):
            for batch in (1, 32):
                data = digits if ds == "digits" else (xtr[: ftrain[batch]], ytr[: ftrain[batch]], xte, yte)
                print(f"accuracy: {ds} batch {batch}", flush=True)
                res[(ds, batch)] = run_accuracy(data, sizes, ep[batch], batch, seeds, methods)
        md += [
            "## 1 + 5. No false alarms; accuracy",
            "",
            f"Digits: 64-32-10, 1347 train / 450 test, batch 1 for {d_ep[1]} epochs and batch 32 for {d_ep[32]} epochs. "
            f"Fashion-MNIST: 784-256-10, **subsampled** to keep the run to minutes on a shared CPU: batch 1 for {f_ep[1]} "
            f"epoch over the first {ftrain[1]} training images, batch 32 for {f_ep[32]} epochs over the first {ftrain[32]}; "
            "the 10 000 test images. "
            "Data reshuffled every epoch. *max g/baseline* = the largest `gap_growth_rate` after the warm-up over all "
            "seeds (an explosion needs > 10).",
            "",
            "| data | batch | Tween acc (%) | SGD+mom acc (%) | AdamW acc (%) | Tween explosions (per run) | Tween max g/baseline | Tween time/run (s) | SGD+mom time/run (s) |",
            "|---|---|---|---|---|---|---|---|---|",
        ]
        no_false, acc_ok = True, True
        for (ds, batch), r in res.items():
            ex = r["Tween"]["explosions"]
            no_false &= all(e == 0 for e in ex)
            gap = statistics.mean(r["Tween"]["acc"]) - statistics.mean(r["SGD+mom"]["acc"])
            acc_ok &= gap >= -0.01
            md.append(
                f"| {ds} | {batch} | {mean_std(r['Tween']['acc'], scale=100)} | {mean_std(r['SGD+mom']['acc'], scale=100)} | "
                f"{mean_std(r['AdamW']['acc'], scale=100)} | {', '.join(map(str, ex))} | {r['Tween']['max_growth']:.2f} | "
                f"{mean_std(r['Tween']['time'], '{:.1f}')} | {mean_std(r['SGD+mom']['time'], '{:.1f}')} |"
            )
        md.append("")
        verdicts.append(f"- Promise 1, no false alarms: {met(no_false)} (explosions per run in the table).")
        diffs = ", ".join(
            f"{ds} b{b} {100 * (statistics.mean(r['Tween']['acc']) - statistics.mean(r['SGD+mom']['acc'])):+.2f}"
            for (ds, b), r in res.items()
        )
        verdicts.append(f"- Promise 5, accuracy ≥ SGD+mom − 1 point: {met(acc_ok)} (Tween − SGD+mom, points: {diffs}).")

    if "faults" in args.parts:
        pre_ep, post_ep = (1, 1) if q else (5, 20)
        methods = ["Tween", "Tween (no det.)", "SGD+mom", "AdamW"]
        md += [
            "## 2. Injected faults",
            "",
            f"Digits 64-32-10, batch 16: {pre_ep} epochs of training, then the fault, then {post_ep} more epochs "
            f"({post_ep * 85} steps). Loss = cross-entropy over the whole training set after every step. *detected* = "
            "steps after the fault until Tween's first explosion (the first step after the fault is step 1; in brackets, "
            "counted from the first step in which any sample contributed a gradient — before it every sample is gated, "
            "nothing is updated, and a fault cannot show in the gaps); *recovered* = steps until "
            "the loss is ≤ its pre-fault value; *max g/baseline* = the largest `gap_growth_rate` in the 5 steps after "
            "the fault. A learning-rate fault runs 3 steps at K × the method's rate (for Tween: `adaptive_rate` and the "
            "step's ceiling both set to K × base_rate), momentum carries on as usual.",
            "",
            "| fault | method | pre-fault loss | peak loss | recovered after (steps) | final loss | test acc (%) before → end | detected after (steps) | explosions / adaptive rate at end | max g/baseline |",
            "|---|---|---|---|---|---|---|---|---|---|",
        ]
        fault_rows = {}
        for fname, fault in FAULTS.items():
            print(f"faults: {fname}", flush=True)
            rc = run_fault(digits, fault, pre_ep, post_ep, 16, seeds, methods)
            fault_rows[fname] = rc
            for name in methods:
                r = rc[name]
                col = lambda k, f="{:.3f}": mean_std([x[k] for x in r], f)
                tw = r[0]["explosions"] is not None
                md.append(
                    f"| {fname} | {name} | {col('pre')} | {col('peak', '{:.3g}')} | {fmt_steps([x['recovered'] for x in r], r[0]['steps'])} | "
                    f"{col('final')} | {col('acc_pre', '{:.3f}')} → {col('acc', '{:.3f}')} | "
                    + (f"{fmt_detect(r) if name == 'Tween' else '—'} | "
                       f"{col('explosions', '{:.0f}')} / {col('rate_end', '{:.2g}')} | {max(x['growth5'] for x in r):.3g} |" if tw else "— | — | — |")
                )
        md.append("")
        for fname, rc in fault_rows.items():
            det = [x["detected"] for x in rc["Tween"]]
            det_active = [None if x["detected"] is None else x["detected"] - x["active"] + 1 for x in rc["Tween"]]
            caught = all(d is not None and d <= 3 for d in det)
            caught_active = all(d is not None and d <= 3 for d in det_active)
            rec_t = [x["recovered"] if x["recovered"] is not None else math.inf for x in rc["Tween"]]
            rec_s = [x["recovered"] if x["recovered"] is not None else math.inf for x in rc["SGD+mom"]]
            sooner = all(a < b for a, b in zip(rec_t, rec_s))
            verdicts.append(
                f"- Promise 2, {fname}: caught within 3 steps {met(caught)} (detected after {det} steps; within 3 steps of the "
                f"first step with a gradient: {met(caught_active)}, {det_active}); loss back below pre-fault "
                f"sooner than SGD+mom {met(sooner)} (Tween {rec_t}, SGD+mom {rec_s} steps; inf = not within {rc['Tween'][0]['steps']})."
            )

    if "switch" in args.parts:
        pa, pb = (300, 300) if q else (2000, 3000)
        methods = ["Tween", "Tween (no det.)", "SGD+mom", "AdamW"]
        print("task switch", flush=True)
        rs = run_switch(digits, pa, pb, 100, seeds, methods)
        md += [
            "## 3. Task switch (online, batch 1, test-then-train)",
            "",
            f"Digits training split, {pa} samples of task A, then {pb} samples with the labels permuted "
            "(0→3, 1→7, 2→5, 3→9, 4→0, 5→2, 6→8, 7→1, 8→4, 9→6). Each sample is predicted first, then trained on; accuracy "
            "in windows of 100 samples. *pre* = mean of the last 3 windows before the switch; *to 80 %* = samples after "
            "the switch until the end of the first window with accuracy ≥ 0.8 × pre; *end* = test-split accuracy "
            "under the new labels after the stream.",
            "",
            "| method | pre (%) | lowest window after (%) | to 80 % (samples) | end, new task (%) | explosions / lowest adaptive rate after the switch |",
            "|---|---|---|---|---|---|",
        ]
        for name in methods:
            r = rs[name]
            col = lambda k: mean_std([x[k] for x in r], scale=100)
            tw = r[0]["explosions"] is not None
            ex = f"{mean_std([x['explosions'] for x in r], '{:.0f}')} / {mean_std([x['rate_min'] for x in r], '{:.2g}')}" if tw else "—"
            md.append(f"| {name} | {col('pre')} | {col('low')} | {fmt_steps([x['rec'] for x in r], pb)} | {col('end')} | {ex} |")
        md += ["", "Window accuracies (%), seed 0:", ""]
        for name in methods:
            md.append(f"- {name}: " + " ".join(f"{100 * w:.0f}" for w in rs[name][0]["windows"]))
        md.append("")
        rt, rsg = [x["rec"] for x in rs["Tween"]], [x["rec"] for x in rs["SGD+mom"]]
        et, es = statistics.mean(x["end"] for x in rs["Tween"]), statistics.mean(x["end"] for x in rs["SGD+mom"])
        fast = statistics.mean(rt) <= statistics.mean(rsg)
        verdicts.append(
            f"- Promise 3, task switch: recovery at least as fast as SGD+mom {met(fast)} (to 80 %: Tween {rt}, SGD+mom {rsg} "
            f"samples, compared on the mean); ends within 2 points {met(et >= es - 0.02)} (Tween {100 * et:.2f} %, SGD+mom {100 * es:.2f} %)."
        )

    if "aggressive" in args.parts:
        lrs = [0.3, 1.0] if q else [0.1, 0.3, 0.5, 0.7, 1.0, 3.0]
        ep = 2 if q else 10
        methods = ["Tween", "Tween (no det.)", "SGD+mom"]
        print("aggressive", flush=True)
        ra = run_aggressive(digits, lrs, ep, 32, seeds, methods)
        md += [
            "## 4. Aggressive learning rates",
            "",
            f"Digits 64-32-10, batch 32, {ep} epochs at learning rate lr (Tween's base_rate = SGD's lr; momentum 0.9 for "
            "both). *diverged* = NaN/Inf weights or test accuracy ≤ 20 % (chance is 10 %).",
            "",
            "| lr | method | test acc (%) | diverged runs | explosions | max g/baseline |",
            "|---|---|---|---|---|---|",
        ]
        for lr in lrs:
            for name in methods:
                r = ra[(lr, name)]
                tw = r[0]["explosions"] is not None
                ex = mean_std([x["explosions"] for x in r], "{:.0f}") if tw else "—"
                gr = f"{max(x['growth'] for x in r):.3g}" if tw else "—"
                md.append(f"| {lr} | {name} | {mean_std([x['acc'] for x in r], scale=100)} | {sum(map(diverged, r))}/{len(r)} | {ex} | {gr} |")
        md.append("")
        hot = [lr for lr in lrs if all(diverged(x) for x in ra[(lr, "SGD+mom")])]
        ok = bool(hot) and all(not diverged(x) for lr in hot for x in ra[(lr, "Tween")])
        detail = ", ".join(f"lr {lr}: Tween {mean_std([x['acc'] for x in ra[(lr, 'Tween')]], scale=100)} %" for lr in hot)
        verdicts.append(
            f"- Promise 4, aggressive settings: {met(ok)} (learning rates where every SGD+mom run diverged: "
            f"{hot or 'none among ' + str(lrs)}; {detail or 'nothing to compare'})."
        )

    md += ["## Verdicts (computed by the script from the tables above)", "", *verdicts, "",
           f"Total time: {time.perf_counter() - t_start:.0f} s.", ""]
    text = "\n".join(md)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")
        print(f"written to {args.out}")


if __name__ == "__main__":
    main()
