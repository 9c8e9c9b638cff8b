"""Measure the claims Loom's Tweening document makes (SPEC §9), instead of repeating them. Not in CI.

    python bench/bench_tween_quality.py                 # everything; writes bench/RESULTS_tween.md (copied into bench/RESULTS.md §5)
    python bench/bench_tween_quality.py --parts b c     # only some parts
    python bench/bench_tween_quality.py --quick         # a smoke run (1 seed, tiny sizes)

(a) **accuracy**: scikit-learn digits (64-32-10) and Fashion-MNIST (784-256-10; Debian package
    ``dataset-fashion-mnist``, read from its files, nothing is downloaded), Tween vs SGD with
    momentum vs Adam, 3 seeds, mean ± std of the test accuracy;
(b) **task switching**: online (batch 1), test-then-train on digits through phases A → B → A, where B
    remaps label k → (k+5) mod 10; accuracy in windows of 100 samples; per method the lowest window
    after each switch and the samples needed to get back to 80 % of the pre-switch window;
(c) **explosion**: after some training, one layer's weights are multiplied by 50; does the
    training-set loss come back below its pre-spike value, and after how many steps.

Methods: ``Tween`` = ``TweenConfig()`` (the document's defaults: base_rate 0.01, momentum 0.9, ...);
``Tween (no expl. det.)`` = the same with ``explosion_detection=False``; ``SGD+mom`` = torchloom's
backprop with SGD, momentum 0.9, lr 0.01 (the same rate and momentum as Tween); ``Adam`` = backprop
with ``torch.optim.Adam(lr=1e-3)``. All losses are softmax cross-entropy on class labels.
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
from torchloom.trainers.backprop import BackpropTrainer, TrainingConfig  # noqa: E402
from torchloom.trainers.tween import TweenConfig, TweenState  # noqa: E402

FASHION_DIR = Path("/usr/share/datasets/fashion-mnist")
FASHION_FILES = ("train-images-idx3-ubyte.gz", "train-labels-idx1-ubyte.gz", "t10k-images-idx3-ubyte.gz", "t10k-labels-idx1-ubyte.gz")
RATE = 0.01  # Tween's base_rate and SGD's lr
ADAM_LR = 1e-3


# ------------------------------------------------------------------------------------- data
def load_digits_split():
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    d = load_digits()
    xtr, xte, ytr, yte = train_test_split(d.data / 16.0, d.target, test_size=0.25, random_state=0, stratify=d.target)
    f = lambda a: torch.tensor(a, dtype=torch.float32)
    return f(xtr), torch.tensor(ytr), f(xte), torch.tensor(yte)


def load_fashion():
    missing = [n for n in FASHION_FILES if not (FASHION_DIR / n).is_file()]
    if missing:
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
    def __init__(self, net: Network, detection: bool = True):
        self.net = net
        self.state = TweenState(net, TweenConfig(base_rate=RATE, explosion_detection=detection))

    def step(self, x, y):
        return self.state.step(self.net, x, y)


class BackpropMethod:
    def __init__(self, net: Network, optimizer):
        cfg = TrainingConfig(learning_rate=RATE, loss_type="cross_entropy", optimizer=optimizer, verbose=False)
        self.trainer = BackpropTrainer(net, cfg)

    def step(self, x, y):
        return self.trainer.step(x, y)


METHODS = {
    "Tween": lambda net: TweenMethod(net),
    "Tween (no expl. det.)": lambda net: TweenMethod(net, detection=False),
    "SGD+mom": lambda net: BackpropMethod(net, "momentum"),
    "Adam": lambda net: BackpropMethod(net, torch.optim.Adam(net.parameters(), lr=ADAM_LR)),
}


def make_net(sizes, seed):
    torch.manual_seed(seed)
    layers = [Dense(a, b, "relu") for a, b in zip(sizes[:-2], sizes[1:-1])] + [Dense(sizes[-2], sizes[-1])]
    return Network(*layers)


@torch.no_grad()
def accuracy(net, x, y, chunk=4096):
    correct = sum(int((net(x[i : i + chunk]).argmax(1) == y[i : i + chunk]).sum()) for i in range(0, len(y), chunk))
    return correct / len(y)


def mean_std(values, fmt="{:.2f}", scale=1.0):
    vals = [v * scale for v in values]
    if len(vals) == 1:
        return fmt.format(vals[0])
    return f"{fmt.format(statistics.mean(vals))} ± {fmt.format(statistics.stdev(vals))}"


# ------------------------------------------------------------------------------ (a) accuracy
def run_accuracy(data, sizes, epochs, batch, seeds, methods):
    xtr, ytr, xte, yte = data
    rows = {}
    for name in methods:
        accs, times, explosions = [], [], []
        for seed in seeds:
            net = make_net(sizes, seed)
            m = METHODS[name](net)
            g = torch.Generator().manual_seed(1000 + seed)
            t0 = time.perf_counter()
            for _ in range(epochs):
                perm = torch.randperm(len(ytr), generator=g)
                for i in range(0, len(perm), batch):
                    idx = perm[i : i + batch]
                    m.step(xtr[idx], ytr[idx])
            times.append(time.perf_counter() - t0)
            accs.append(accuracy(net, xte, yte))
            if isinstance(m, TweenMethod):
                explosions.append(m.state.explosion_count)
            print(f"    {name:<22} seed {seed}: test acc {accs[-1]:.4f} ({times[-1]:.1f}s)", flush=True)
        rows[name] = dict(acc=accs, time=times, explosions=explosions)
    return rows


# ------------------------------------------------------------------------ (b) task switching
def run_switching(data, phase_len, window, seeds, methods):
    xtr, ytr, xte, yte = data
    x_all, y_all = torch.cat([xtr, xte]), torch.cat([ytr, yte])
    remap = [lambda y: y, lambda y: (y + 5) % 10, lambda y: y]
    out = {}
    for name in methods:
        per_seed = []
        for seed in seeds:
            net = make_net((64, 32, 10), seed)
            m = METHODS[name](net)
            g = torch.Generator().manual_seed(2000 + seed)
            windows, hits = [], 0
            t0 = time.perf_counter()
            for phase in range(3):
                perm = torch.randperm(len(y_all), generator=g)[:phase_len]
                for j, k in enumerate(perm.tolist()):
                    x, y = x_all[k : k + 1], remap[phase](y_all[k : k + 1])
                    with torch.no_grad():
                        hits += int(net(x).argmax(1).item() == y.item())  # test ...
                    m.step(x, y)  # ... then train
                    if (j + 1) % window == 0:
                        windows.append(hits / window)
                        hits = 0
            per_w = phase_len // window
            res = dict(windows=windows, time=time.perf_counter() - t0)
            for s, switch in enumerate((per_w, 2 * per_w)):
                pre = windows[switch - 1]
                after = windows[switch : switch + per_w]
                back = next((w for w, a in enumerate(after) if a >= 0.8 * pre), None)
                res[f"pre{s}"] = pre
                res[f"min{s}"] = min(after)
                res[f"rec{s}"] = (back + 1) * window if back is not None else math.inf
            res["final"] = windows[-1]
            if isinstance(m, TweenMethod):
                res["explosions"] = m.state.explosion_count
                res["rate_end"] = m.state.adaptive_rate
                res["growth"] = growth_over_limit(m.state.gap_history)
            per_seed.append(res)
            print(f"    {name:<22} seed {seed}: windows {' '.join(f'{w:.2f}' for w in windows)}", flush=True)
        out[name] = per_seed
    return out


# ------------------------------------------------------------------------------ (c) explosion
def run_explosion(data, layer, factor, pre_epochs, post_epochs, batch, seeds, methods):
    xtr, ytr, xte, yte = data
    out = {}
    for name in methods:
        per_seed = []
        for seed in seeds:
            net = make_net((64, 32, 10), seed)
            m = METHODS[name](net)
            g = torch.Generator().manual_seed(3000 + seed)
            batches = lambda: [torch.randperm(len(ytr), generator=g)[i : i + batch] for i in range(0, len(ytr), batch)]
            full_loss = lambda: float(F.cross_entropy(net(xtr), ytr))
            for _ in range(pre_epochs):
                for idx in batches():
                    m.step(xtr[idx], ytr[idx])
            with torch.no_grad():
                pre = full_loss()
                exp_before = m.state.explosion_count if isinstance(m, TweenMethod) else 0
                steps_before = m.state.steps if isinstance(m, TweenMethod) else 0
                net.layers[layer].weight.mul_(factor)
                spiked = full_loss()
                acc_spiked = accuracy(net, xte, yte)
            steps, recovered, peak, skipped, nonfinite = 0, None, spiked, 0, False
            for _ in range(post_epochs):
                for idx in batches():
                    st = m.step(xtr[idx], ytr[idx])
                    steps += 1
                    skipped += st.status.value != "ok"
                    with torch.no_grad():
                        cur = full_loss()
                    nonfinite |= not math.isfinite(cur)
                    peak = max(peak, cur) if math.isfinite(cur) else peak
                    if recovered is None and cur <= pre:
                        recovered = steps
            with torch.no_grad():
                final = full_loss()
            res = dict(pre=pre, spiked=spiked, peak=peak, recovered=recovered, steps=steps, final=final,
                       acc=accuracy(net, xte, yte), acc_spiked=acc_spiked, skipped=skipped, nonfinite=nonfinite)
            if isinstance(m, TweenMethod):
                res["explosions"] = m.state.explosion_count - exp_before
                res["rate_end"] = m.state.adaptive_rate
                res["growth"] = growth_over_limit(m.state.gap_history[steps_before:])
            per_seed.append(res)
            print(f"    {name:<22} seed {seed}: pre {pre:.4f} spiked {spiked:.1f} peak {peak:.1f} recovered after "
                  f"{recovered} steps, final loss {res['final']:.4f}, test acc {res['acc']:.4f}", flush=True)
        out[name] = per_seed
    return out


def growth_over_limit(gap_history, limit=10.0):
    """Fraction of steps whose mean gap grew more than ``limit``-fold over the previous step's."""
    pairs = list(zip(gap_history[:-1], gap_history[1:]))
    return sum(1 for a, b in pairs if a > 0 and b / a > limit) / max(len(pairs), 1)


# --------------------------------------------------------------------------------- reporting
def fmt_steps(values, total):
    done = [v for v in values if v is not None and v != math.inf]
    if not done:
        return f"never (in {total})"
    s = mean_std(done, "{:.0f}")
    return s if len(done) == len(values) else f"{s} ({len(done)}/{len(values)} seeds; rest never in {total})"


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--parts", nargs="+", default=["a", "b", "c"], choices=["a", "b", "c"])
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--digits-epochs", type=int, default=16)
    ap.add_argument("--fashion-epochs", type=int, default=5)
    ap.add_argument("--fashion-train", type=int, default=60000, help="training samples used (the first N)")
    ap.add_argument("--phase", type=int, default=1700, help="samples per task-switching phase")
    ap.add_argument("--quick", action="store_true", help="1 seed, tiny sizes: a smoke run")
    ap.add_argument("--out", default=str(Path(__file__).with_name("RESULTS_tween.md")))
    args = ap.parse_args(argv)
    if args.quick:
        args.seeds, args.digits_epochs, args.fashion_epochs, args.fashion_train, args.phase = 1, 2, 1, 3000, 300
    torch.set_num_threads(1)  # small networks; the machine's 2 cores are shared
    seeds = list(range(args.seeds))
    batch_methods = ["Tween", "SGD+mom", "Adam"]
    all_methods = ["Tween", "Tween (no expl. det.)", "SGD+mom", "Adam"]
    cmd = "python bench/bench_tween_quality.py " + " ".join(argv if argv is not None else sys.argv[1:])
    md = [
        "# Neural Tweening: measured quality (SPEC §9)",
        "",
        f"Date: {datetime.date.today()}. Machine: 2-core CPU shared with other jobs "
        f"({platform.processor() or platform.machine()}), torch {torch.__version__}, 1 thread. Command: `{cmd.strip()}`.",
        "",
        f"Methods: **Tween** = `TweenConfig()` (base_rate {RATE}, momentum 0.9, link_budget_scale 1, gap_threshold 0.1, "
        "explosion_limit 10, recovery_rate 0.5, depth scaling on); **Tween (no expl. det.)** = the same with "
        f"`explosion_detection=False`; **SGD+mom** = backprop, SGD lr {RATE}, momentum 0.9 (Tween's rate and momentum); "
        f"**Adam** = backprop, `torch.optim.Adam(lr={ADAM_LR})`. Softmax cross-entropy everywhere; ReLU hidden layers; "
        f"He-normal init; seeds {seeds} (init and data order). Times are wall-clock on busy shared cores: compare "
        "them only roughly.",
        "",
    ]

    if "a" in args.parts:
        print("(a) accuracy: digits", flush=True)
        digits = load_digits_split()
        rd = run_accuracy(digits, (64, 32, 10), args.digits_epochs, 16, seeds, batch_methods)
        print("(a) accuracy: Fashion-MNIST", flush=True)
        xtr, ytr, xte, yte = load_fashion()
        fashion = (xtr[: args.fashion_train], ytr[: args.fashion_train], xte, yte)
        rf = run_accuracy(fashion, (784, 256, 10), args.fashion_epochs, 32, seeds, batch_methods)
        md += [
            "## (a) Accuracy",
            "",
            f"Digits: 64-32-10, 1347 train / 450 test (stratified split, random_state 0), inputs /16, batch 16, "
            f"{args.digits_epochs} epochs. Fashion-MNIST: 784-256-10, the first {args.fashion_train} training images, "
            f"the 10 000 test images, inputs /255, batch 32, {args.fashion_epochs} epochs. Data reshuffled every epoch.",
            "",
            "| method | digits test acc (%) | digits time/run (s) | Fashion-MNIST test acc (%) | F-MNIST time/run (s) | explosions detected (digits / F-MNIST) |",
            "|---|---|---|---|---|---|",
        ]
        for name in batch_methods:
            e = "—" if not rd[name]["explosions"] else f"{mean_std(rd[name]['explosions'], '{:.1f}')} / {mean_std(rf[name]['explosions'], '{:.1f}')}"
            md.append(
                f"| {name} | {mean_std(rd[name]['acc'], scale=100)} | {mean_std(rd[name]['time'], '{:.1f}')} | "
                f"{mean_std(rf[name]['acc'], scale=100)} | {mean_std(rf[name]['time'], '{:.0f}')} | {e} |"
            )
        md.append("")

    if "b" in args.parts:
        print("(b) task switching", flush=True)
        rb = run_switching(load_digits_split(), args.phase, 100, seeds, all_methods)
        md += [
            "## (b) Task switching (online, batch 1, test-then-train)",
            "",
            f"Digits (all 1797 samples), 64-32-10, phases A → B → A of {args.phase} samples each (a fresh random order per "
            "phase), B remaps label k → (k+5) mod 10. Each sample is predicted first, then trained on. Accuracy in windows of "
            "100 samples. *pre* = the last window before the switch; *lowest* = the lowest window in the next phase; "
            "*to 80 %* = samples after the switch until the end of the first window with accuracy ≥ 0.8 × pre.",
            "",
            "| method | pre A→B | lowest after A→B | to 80 % (samples) | pre B→A | lowest after B→A | to 80 % (samples) | last window | explosions / adaptive rate at end | steps with gap growth > 10× |",
            "|---|---|---|---|---|---|---|---|---|---|",
        ]
        for name in all_methods:
            r = rb[name]
            col = lambda k: mean_std([x[k] for x in r], scale=100)
            tw = "explosions" in r[0]
            ex = f"{mean_std([x['explosions'] for x in r], '{:.0f}')} / {mean_std([x['rate_end'] for x in r], '{:.2g}')}" if tw else "—"
            gr = f"{col('growth')} %" if tw else "—"
            md.append(
                f"| {name} | {col('pre0')} | {col('min0')} | {fmt_steps([x['rec0'] for x in r], args.phase)} | {col('pre1')} | "
                f"{col('min1')} | {fmt_steps([x['rec1'] for x in r], args.phase)} | {col('final')} | {ex} | {gr} |"
            )
        md += ["", "Window accuracies (%), seed 0:", ""]
        for name in all_methods:
            md.append(f"- {name}: " + " ".join(f"{100 * w:.0f}" for w in rb[name][0]["windows"]))
        md.append("")

    if "c" in args.parts:
        print("(c) explosion", flush=True)
        digits = load_digits_split()
        md += [
            "## (c) Explosion: one layer's weights × 50 mid-training",
            "",
            "Digits, 64-32-10, batch 16: 5 epochs of training, then the weights (not the bias) of one layer are multiplied "
            "by 50, then 10 more epochs (850 steps). Loss = cross-entropy over the whole training set after every step. "
            "*recovered* = first step whose loss is ≤ the pre-spike loss.",
            "",
            "| spiked layer | method | pre-spike loss | loss after spike | peak loss | recovered after (steps) | final loss | test acc (%) after spike → end | explosions after spike / adaptive rate at end | steps with gap growth > 10× |",
            "|---|---|---|---|---|---|---|---|---|---|",
        ]
        for layer in (0, 1):
            rc = run_explosion(digits, layer, 50.0, 5 if not args.quick else 1, 10 if not args.quick else 1, 16, seeds, all_methods)
            for name in all_methods:
                r = rc[name]
                col = lambda k, f="{:.3f}": mean_std([x[k] for x in r], f)
                tw = "explosions" in r[0]
                ex = f"{col('explosions', '{:.0f}')} / {col('rate_end', '{:.2g}')}" if tw else "—"
                gr = f"{mean_std([x['growth'] for x in r], scale=100)} %" if tw else "—"
                acc = f"{mean_std([x['acc_spiked'] for x in r], scale=100)} → {mean_std([x['acc'] for x in r], scale=100)}"
                md.append(
                    f"| {layer} | {name} | {col('pre')} | {col('spiked', '{:.1f}')} | {col('peak', '{:.1f}')} | "
                    f"{fmt_steps([x['recovered'] for x in r], r[0]['steps'])} | {col('final')} | {acc} | {ex} | {gr} |"
                )
        md.append("")

    text = "\n".join(md)
    print(text)
    if not args.quick:
        Path(args.out).write_text(text + "\n")
        print(f"written to {args.out}")


if __name__ == "__main__":
    main()
