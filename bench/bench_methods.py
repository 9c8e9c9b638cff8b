"""Every method learns: test accuracy of backprop, TargetProp and Tween on three classification tasks.

A 784-256-256-10 ReLU network of torchloom ``Dense`` layers (the input size is the data's own: 64 for
digits, 40 for MNIST-1D) trained with ``torchloom.train`` for a fixed epoch budget, one rate per method
at every batch size, several seeds; one table per data set:

* ``bp-sgdm``: backprop, SGD with momentum 0.9 (``optimizer="momentum"``), cross-entropy, lr 0.01
  (``TrainingConfig``'s default rate): the reference every target is measured against;
* ``bp-adamw``: backprop, AdamW (``optimizer="adamw"``), cross-entropy, lr 1e-3 (torch's default; 0.01
  is too large a step for Adam on these nets);
* ``tp-chain``: ``method="target_prop"`` (chain rule, the step averaged over the batch), cross-entropy,
  lr 0.1 (what ``TargetPropConfig``'s default ``learning_rate=None`` gives the chain rule from 16 rows up);
* ``tp-pure``: ``TargetPropConfig(use_chain_rule=False)`` (difference targets, the default), cross-entropy,
  lr 0.05 (its default from 16 rows up; Loom's own pure rule, ``pure_targets="loom"``, stays at chance at
  every rate on Fashion-MNIST);
* ``tween``: ``TweenConfig``'s defaults, base rate 0.03 (what ``base_rate=None`` gives from 16 rows up),
  cross-entropy;
* the feedback rules (docs/choosing-a-method.md), each SGD with momentum 0.9 as ``bp-sgdm``,
  cross-entropy, their configs' defaults (feedback seed 0, scale 0.1): ``fa`` (``method="feedback_alignment"``,
  lr 0.01), ``dfa`` (``method="dfa"``, lr 0.01), ``sign-sym`` (``method="sign_symmetry"``, ``s = mean|W|``,
  lr 0.01) and ``fast-proxy`` (``method="fast_proxy"``, Welvet's FastProxy, lr 0.003: at 0.01 with
  momentum its first layer diverged on Fashion-MNIST); ``fa-adamw`` and ``dfa-adamw``: the same rules
  with AdamW at 3e-4 (Adam's per-weight scaling makes the feedback's scale irrelevant; on Fashion-MNIST,
  10 epochs, seed 0, CPU: DFA 85.1 % at batch 32 and 256, FA 84.8 % at batch 32, against 85.0 / 84.1 %
  and 83.0 % with SGD + momentum);
* ``<method>-tanh`` (``bp-sgdm``, ``fa``, ``dfa``, ``sign-sym``, ``fast-proxy``, ``fa-adamw``,
  ``dfa-adamw``): the same on a tanh network (784-256-256-10, tanh hidden units, as in Nøkland 2016's
  DFA experiments); ``fa-tanh`` and ``dfa-tanh`` use He-scaled feedback (``scale=1.0``: the default 0.1
  is for ReLU networks, where 1 diverged), the AdamW rows lr 1e-3, ``fast-proxy-tanh`` lr 0.01 (its
  first tanh layer stays stable there; 0.003 left it 1.3 points under DFA at batch 256). On the ReLU network random feedback
  leaves the hidden layers little to learn from (a ReLU unit's derivative is 0 wherever the feedback
  pushed it below zero); on Fashion-MNIST (10 epochs, batch 256, seed 0, CPU) DFA went from 84.8 %
  (AdamW, ReLU) to 87.9 % (AdamW, tanh), FA from 85.5 % to 87.0 % (SGD + momentum, scale 1, tanh).

Each method trains on the loss of the ``LOSSES`` table; ``--loss-<method>`` tries another loss, and a
combination ``TrainingConfig`` or ``train()`` refuses is reported as a ``refused: <message>`` row.
``--lr-<method>`` changes a rate; ``--schedule-<method> cosine`` anneals it once per epoch from that rate
to 0 over the epoch budget (the same rates at every batch size), ``--clip-<method> C`` sets
``gradient_clip=C`` (global L2 norm of the averaged step). Pure TargetProp passes 85 % on Fashion-MNIST
at both batch sizes with ``--lr-tp-pure 0.3 --schedule-tp-pure cosine --clip-tp-pure 1`` (CPU screen,
seeds 0–2; bench/RESULTS.md §7), where no constant rate does.

Data, all offline (nothing is downloaded): scikit-learn's bundled ``load_digits`` (1347 train / 450
test, stratified, ``random_state=0``); Fashion-MNIST from the Debian package ``dataset-fashion-mnist``
(60,000 / 10,000); MNIST-1D generated locally by the PyPI package ``mnist1d`` (``make_dataset`` with its
default arguments: 4,000 / 1,000; its ``get_dataset`` would download, and is never called). Inputs are
standardised with one mean and one std over all training values (the usual MNIST normalisation;
per-pixel scaling puts rare Fashion-MNIST border pixels at |z| ≈ 280 in the test set).

A run counts as **diverged** when its final training loss is not finite or its test accuracy is within
5 points of chance (10 %); ``skipped`` counts the steps the NaN/Inf guards refused (a run whose steps
are all refused keeps its weights and can look alive). ``s/epoch``: median epoch time of the runs in
which no step was refused (a refused step can abandon the rest of its epoch). Targets of the issue "Every method learns":
TargetProp chain and Tween ≥ backprop SGD+momentum − 1 point, TargetProp pure ≥ 85 % on Fashion-MNIST,
with the same rate at both batch sizes. Targets of the issue "The credit-assignment zoo", on Fashion-MNIST:
DFA ≥ 87 %, FA ≥ 86.5 %, sign symmetry ≥ backprop SGD+momentum − 1 point, FastProxy ≥ DFA − 1 point.

Run from the repository root (times measured on this project's 2-core CPU machine, busy with other jobs;
``--threads 1`` because two torch threads there made some epochs 10–30× slower)::

    PYTHONPATH=. python bench/bench_methods.py --threads 1 --markdown   # everything: ~40 min
    PYTHONPATH=. python bench/bench_methods.py --datasets fashion --max-train 10000 --threads 1   # 7 min
    PYTHONPATH=. python bench/bench_methods.py --dry-run     # digits, 1 seed, 1 epoch, 2 methods: seconds
    PYTHONPATH=. python bench/bench_methods.py --device cuda --jobs 8 --markdown   # GPU: 8 rows at a time

``--jobs N`` trains N runs (a method at a batch size and a seed) at once in worker processes (spawned;
each loads the data itself): the small networks leave a GPU and a many-core host mostly idle, so the
accuracy table comes N times sooner. ``s/epoch`` then counts N runs sharing the device: it compares
methods within one run, not with a run of other ``--jobs``.

Needs ``scikit-learn`` (digits), ``apt-get install dataset-fashion-mnist`` and ``pip install mnist1d``.
"""

from __future__ import annotations

import argparse
import gzip
import math
import os
import platform
import statistics
import sys
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np
import torch
from torch import Tensor

import torchloom
from torchloom import Dense, DFAConfig, FeedbackAlignmentConfig, Network, TargetPropConfig, TrainingConfig, TweenConfig

# ------------------------------------------------------------------------------------- data
# Debian's package puts the four files here; TORCHLOOM_FASHION_DIR names another folder holding them
FASHION_DIR = Path(os.environ.get("TORCHLOOM_FASHION_DIR", "/usr/share/datasets/fashion-mnist"))
FASHION_FILES = ("train-images-idx3-ubyte.gz", "train-labels-idx1-ubyte.gz", "t10k-images-idx3-ubyte.gz", "t10k-labels-idx1-ubyte.gz")

Split = tuple[Tensor, Tensor, Tensor, Tensor]  # x_train, y_train, x_test, y_test


class DataMissing(RuntimeError):
    """A data set's files or package are not on this machine; the message says what to install."""


def standardise(split: Split) -> Split:
    """Inputs shifted and scaled by one mean and one std over all training values."""
    xtr, ytr, xte, yte = split
    mean, std = xtr.mean(), xtr.std()
    return (xtr - mean) / std, ytr, (xte - mean) / std, yte


def _tensors(xtr, ytr, xte, yte) -> Split:
    f = lambda a: torch.as_tensor(np.asarray(a, dtype=np.float32))
    i = lambda a: torch.as_tensor(np.asarray(a, dtype=np.int64))
    return f(xtr), i(ytr), f(xte), i(yte)


def load_digits() -> Split:
    try:
        from sklearn.datasets import load_digits as sk_digits
        from sklearn.model_selection import train_test_split
    except ImportError:
        raise DataMissing("digits needs scikit-learn (pip install scikit-learn)") from None
    d = sk_digits()
    xtr, xte, ytr, yte = train_test_split(d.data, d.target, test_size=0.25, random_state=0, stratify=d.target)
    return _tensors(xtr, ytr, xte, yte)


def _idx(name: str) -> np.ndarray:
    """One gzip'd idx file of the Debian package: images ``[n, 784]`` or labels ``[n]``, uint8."""
    with gzip.open(FASHION_DIR / name) as f:
        raw = f.read()
    dims = raw[3]  # magic 0x0000 08 <dims>, then one big-endian uint32 per dimension
    shape = np.frombuffer(raw, ">u4", count=dims, offset=4)
    data = np.frombuffer(raw, np.uint8, offset=4 + 4 * dims)
    return data.reshape(int(shape[0]), -1) if dims > 1 else data


def load_fashion() -> Split:
    missing = [n for n in FASHION_FILES if not (FASHION_DIR / n).is_file()]
    if missing:
        raise DataMissing(
            f"Fashion-MNIST not found in {FASHION_DIR} (missing {', '.join(missing)}): install Debian's package "
            "dataset-fashion-mnist (apt-get install dataset-fashion-mnist); this benchmark never downloads"
        )
    return _tensors(*(_idx(n) for n in FASHION_FILES))


def load_mnist1d() -> Split:
    """MNIST-1D generated here by ``mnist1d.data.make_dataset`` with ``get_dataset_args()``'s defaults
    (5,000 signals of 40 samples, 80 % train, seed 42). ``get_dataset`` (download or pickle cache) is
    never called. ``make_dataset`` seeds NumPy's and ``random``'s global generators (its own rule)."""
    try:
        from mnist1d.data import get_dataset_args, make_dataset
    except ImportError:
        raise DataMissing("MNIST-1D needs the PyPI package mnist1d (pip install mnist1d); it generates the data locally") from None
    d = make_dataset(get_dataset_args())
    return _tensors(d["x"], d["y"], d["x_test"], d["y_test"])


@dataclass(frozen=True)
class Data:
    title: str
    epochs: int  # the default epoch budget: ~10k–40k steps of batch 32 at most, to fit 2 CPU cores
    load: Callable[[], Split]


DATASETS = {
    "digits": Data("digits (scikit-learn)", 30, load_digits),
    "fashion": Data("Fashion-MNIST", 10, load_fashion),
    "mnist1d": Data("MNIST-1D (generated)", 30, load_mnist1d),
}

# ---------------------------------------------------------------------------------- methods
# the documented defaults at the batch sizes here (32, 256): TargetPropConfig(learning_rate=None) is 0.1 for the
# chain rule and 0.05 for pure mode (0.1 is unstable there over 10 epochs, §7 run D), TweenConfig(base_rate=None)
# 0.03 (bench/RESULTS.md §7 run E; both scale by B/16 below 16 rows, run F). tests/trainers/test_bench_methods.py
# checks that these stay the configs' defaults
RATES = {"bp-sgdm": 0.01, "bp-adamw": 1e-3, "tp-chain": 0.1, "tp-pure": 0.05, "tween": 0.03,
         "fa": 0.01, "dfa": 0.01, "sign-sym": 0.01, "fast-proxy": 0.003, "fa-adamw": 3e-4, "dfa-adamw": 3e-4,
         # the same rules on a tanh network (784-256-256-10 with tanh hidden units, as Nøkland 2016's DFA
         # networks): random feedback keeps every tanh unit's derivative alive, where it silences ReLU units
         "bp-sgdm-tanh": 0.01, "fa-tanh": 0.01, "dfa-tanh": 0.01, "sign-sym-tanh": 0.01, "fast-proxy-tanh": 0.01,
         "fa-adamw-tanh": 1e-3, "dfa-adamw-tanh": 1e-3}
LOSSES = {m: "cross_entropy" for m in RATES}
FEEDBACK_RULES = {"fa": "feedback_alignment", "dfa": "dfa", "sign-sym": "sign_symmetry", "fast-proxy": "fast_proxy",
                  "fa-adamw": "feedback_alignment", "dfa-adamw": "dfa"}
TANH = "-tanh"  # a method name ending in it: the same method on the tanh network


def activation(name: str) -> str:
    """The hidden layers' activation of method ``name``'s network."""
    return "tanh" if name.endswith(TANH) else "relu"


def method_fields(name: str, lr: float, loss: str) -> dict:
    """The ``TrainingConfig`` fields of method ``name`` at rate ``lr`` on ``loss`` (public API only)."""
    if name.endswith(TANH):
        base = name[: -len(TANH)]
        if base in ("fa", "dfa"):  # with SGD + momentum: He-scaled feedback (scale 1; 0.1 is for ReLU nets)
            rule = FeedbackAlignmentConfig(scale=1.0) if base == "fa" else DFAConfig(scale=1.0)
            return dict(method=rule, optimizer="momentum", learning_rate=lr, loss_type=loss)
        return method_fields(base, lr, loss)
    if name == "bp-sgdm":
        return dict(optimizer="momentum", learning_rate=lr, loss_type=loss)
    if name == "bp-adamw":
        return dict(optimizer="adamw", learning_rate=lr, loss_type=loss)
    if name == "tp-chain":
        return dict(method="target_prop", learning_rate=lr, loss_type=loss)
    if name == "tp-pure":
        return dict(method=TargetPropConfig(use_chain_rule=False, learning_rate=lr), loss_type=loss)
    if name in FEEDBACK_RULES:  # backprop's machinery (SGD with momentum, as bp-sgdm; or AdamW) with the rule's own backward
        opt = "adamw" if name.endswith("-adamw") else "momentum"
        return dict(method=FEEDBACK_RULES[name], optimizer=opt, learning_rate=lr, loss_type=loss)
    if name == "tween":  # by instance: method="tween" by name maps loss_type "mse" to automatic (cross-entropy for labels)
        return dict(method=TweenConfig(base_rate=lr, loss_type=loss), loss_type=loss)
    raise ValueError(f"unknown method {name!r}")


# ---------------------------------------------------------------------------------- one run
CHANCE_MARGIN = 0.05  # a run within 5 points of chance accuracy has not learned: diverged


@dataclass
class Run:
    accuracy: float = math.nan
    final_loss: float = math.nan
    epoch_time: float = math.nan  # median seconds per epoch
    skipped: int = 0  # steps the NaN/Inf guards refused
    refused: str | None = None  # the message when the configuration was refused

    def diverged(self, classes: int) -> bool:
        return not math.isfinite(self.final_loss) or not self.accuracy > 1 / classes + CHANCE_MARGIN


def classes(split: Split) -> int:
    return int(max(split[1].max(), split[3].max())) + 1


def make_net(n_in: int, n_out: int, seed: int, act: str = "relu") -> Network:
    torch.manual_seed(seed)
    return Network(Dense(n_in, 256, act), Dense(256, 256, act), Dense(256, n_out))


SCHEDULES = ("constant", "cosine")  # --schedule-<method>: the rate held, or annealed per epoch to 0


def schedule_fields(schedule: str, lr: float, epochs: int, clip: float = 0.0) -> dict:
    """The ``TrainingConfig`` fields of ``--schedule-<method>`` and ``--clip-<method>``: ``"constant"``
    adds nothing; ``"cosine"`` anneals the rate once per epoch, ``lr`` in the first epoch down to 0 at
    the end of the budget (``cosine_annealing(lr, 0, epochs)``, ``scheduler_interval="epoch"``: the same
    rates at every batch size); ``clip > 0`` is ``gradient_clip`` (global L2 norm of the averaged step)."""
    fields: dict = {}
    if schedule == "cosine":
        fields.update(scheduler=torchloom.schedules.cosine_annealing(lr, 0.0, epochs), scheduler_interval="epoch")
    elif schedule != "constant":
        raise ValueError(f"unknown schedule {schedule!r}; valid: {', '.join(SCHEDULES)}")
    if clip > 0:
        fields["gradient_clip"] = clip
    return fields


def run_one(method: str, split: Split, batch: int, lr: float, loss: str, epochs: int, seed: int, device: str, precision: str,
            clip: float = 0.0, schedule: str = "constant") -> Run:
    """One training run from a fresh network (init and data order seeded by ``seed``) and its test accuracy
    (``clip``, ``schedule``: ``schedule_fields``)."""
    xtr, ytr, xte, yte = split
    net = make_net(xtr.shape[1], classes(split), seed, activation(method))
    try:
        config = TrainingConfig(
            epochs=epochs, batch_size=batch, shuffle=True, seed=seed, device=device, precision=precision, verbose=0,
            **method_fields(method, lr, loss), **schedule_fields(schedule, lr, epochs, clip),
        )
        with warnings.catch_warnings():  # a diverged epoch warns; the row reports it
            warnings.simplefilter("ignore", torchloom.DivergenceWarning)
            result = torchloom.train(net, (xtr, ytr), config)
    except (ValueError, TypeError) as e:  # train() checks every setting before any weight changes
        return Run(refused=str(e))
    acc = torchloom.evaluate(net, (xte, yte), loss_type="cross_entropy", metrics=("accuracy",), batch_size=2048)["accuracy"]
    return Run(acc, result.final_loss, statistics.median(result.epoch_times), result.skipped_batches)


# ---------------------------------------------------------------------------------- summary
@dataclass
class Row:
    method: str
    batch: int
    lr: float
    loss: str
    runs: list[Run] = field(default_factory=list)
    clip: float = 0.0  # --clip-<method>, --schedule-<method>: schedule_fields
    schedule: str = "constant"

    def accuracies(self) -> list[float]:
        return [r.accuracy for r in self.runs]

    def cells(self, classes: int) -> list[str]:
        rate = f"{self.lr:g}" + (f" {self.schedule}" if self.schedule != "constant" else "") + (f", clip {self.clip:g}" if self.clip > 0 else "")
        head = [self.method, str(self.batch), rate, self.loss]
        refused = next((r.refused for r in self.runs if r.refused), None)
        if refused:
            return head + [f"refused: {refused}", "—", "—", "—"]
        accs = [100 * a for a in self.accuracies()]
        acc = f"{accs[0]:.2f}" if len(accs) == 1 else f"{statistics.mean(accs):.2f} ± {statistics.stdev(accs):.2f}"
        diverged = sum(r.diverged(classes) for r in self.runs)
        blown = sum(not math.isfinite(r.final_loss) for r in self.runs)
        whole = [r.epoch_time for r in self.runs if r.skipped == 0]  # a refused step can abandon its epoch
        return head + [
            acc,
            f"{diverged}/{len(self.runs)}" + (f" ({blown} non-finite)" if blown else ""),
            f"{statistics.mean(r.skipped for r in self.runs):g}",
            f"{statistics.median(whole):.2f}" if whole else "—",
        ]


HEADER = ["method", "batch", "lr", "loss", "test acc (%)", "diverged", "skipped steps", "s/epoch"]

# the targets: (label, method, reference method or None, points below it / absolute %, data sets)
TARGETS = [
    ("TargetProp chain ≥ backprop SGD+mom − 1 point", "tp-chain", "bp-sgdm", 1.0, None),
    ("TargetProp pure ≥ 85 %", "tp-pure", None, 85.0, ("fashion",)),
    ("Tween ≥ backprop SGD+mom − 1 point", "tween", "bp-sgdm", 1.0, None),
    ("DFA ≥ 87 %", "dfa", None, 87.0, ("fashion",)),
    ("FA ≥ 86.5 %", "fa", None, 86.5, ("fashion",)),
    ("sign symmetry ≥ backprop SGD+mom − 1 point", "sign-sym", "bp-sgdm", 1.0, None),
    ("FastProxy ≥ DFA − 1 point", "fast-proxy", "dfa", 1.0, None),
    ("DFA ≥ 87 % (tanh network)", "dfa-tanh", None, 87.0, ("fashion",)),
    ("DFA, AdamW ≥ 87 % (tanh network)", "dfa-adamw-tanh", None, 87.0, ("fashion",)),
    ("FA ≥ 86.5 % (tanh network)", "fa-tanh", None, 86.5, ("fashion",)),
    ("FA, AdamW ≥ 86.5 % (tanh network)", "fa-adamw-tanh", None, 86.5, ("fashion",)),
    ("sign symmetry ≥ backprop SGD+mom − 1 point (tanh network)", "sign-sym-tanh", "bp-sgdm-tanh", 1.0, None),
    ("FastProxy ≥ DFA − 1 point (tanh network)", "fast-proxy-tanh", "dfa-tanh", 1.0, None),
]
ANCHORS = (
    "Published anchors, Fashion-MNIST, 784-256-256-10-style MLPs, full training set and long schedules: "
    "backprop ≈ 89–90 %, DFA ≈ 87 %, local-loss predsim 91.5 %."
)


def _mean_acc(rows: list[Row], method: str, batch: int) -> float | None:
    row = next((r for r in rows if r.method == method and r.batch == batch), None)
    if row is None or any(r.refused for r in row.runs):
        return None
    return 100 * statistics.mean(row.accuracies())


def verdicts(dataset: str, rows: list[Row], batches: list[int]) -> list[list[str]]:
    """One line per target that applies to ``dataset``: met / not met at each batch size, with the numbers."""
    lines = []
    run = {r.method for r in rows}
    for label, method, ref, value, only in TARGETS:
        if (only and dataset not in only) or method not in run or (ref and ref not in run):
            continue
        cells = [label]
        for b in batches:
            got = _mean_acc(rows, method, b)
            goal = value if ref is None else (None if _mean_acc(rows, ref, b) is None else _mean_acc(rows, ref, b) - value)
            if got is None or goal is None:
                cells.append("— (refused)")
            else:
                cells.append(f"{'met' if got >= goal else 'not met'} ({got:.2f} vs ≥ {goal:.2f})")
        lines.append(cells)
    return lines


def table(header: list[str], rows: list[list[str]], markdown: bool) -> str:
    if markdown:
        lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
        return "\n".join(lines + ["| " + " | ".join(r) + " |" for r in rows])
    widths = [max(len(c) for c in col) for col in zip(header, *rows)]
    fmt = lambda r: "  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip()
    return "\n".join([fmt(header), fmt(["-" * w for w in widths])] + [fmt(r) for r in rows])


# ------------------------------------------------------------------------------------- main
def _list(text: str, kind=str) -> list:
    return [kind(v.strip()) for v in text.split(",") if v.strip()]


def parse(argv) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--datasets", default=",".join(DATASETS), help=f"comma-separated, of {', '.join(DATASETS)}")
    ap.add_argument("--methods", default=None, help=f"comma-separated, of {', '.join(RATES)} (default: all)")
    ap.add_argument("--seeds", type=int, default=5, help="runs per row, seeds 0..N-1 (init and data order)")
    ap.add_argument("--batch-sizes", default="32,256", help="comma-separated; every method uses one rate at all of them")
    ap.add_argument("--epochs", type=int, default=None, help="epoch budget for every data set (default: digits 30, fashion 10, mnist1d 30)")
    ap.add_argument("--max-train", type=int, default=None, help="train on the first N training rows only (the test split stays whole)")
    ap.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    ap.add_argument("--precision", default="32", choices=("32", "bf16-mixed"))
    ap.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's own)")
    ap.add_argument("--markdown", action="store_true", help="markdown tables (for bench/RESULTS.md)")
    ap.add_argument("--jobs", type=int, default=1, help="runs trained at once in worker processes (default 1: in this process)")
    ap.add_argument("--dry-run", action="store_true", help="digits, 1 seed, 1 epoch, bp-sgdm and tween unless --methods: seconds")
    for m in RATES:
        ap.add_argument(f"--lr-{m}", type=float, default=RATES[m], help=f"{m}'s rate (default {RATES[m]:g})")
        ap.add_argument(f"--loss-{m}", default=LOSSES[m], help=f"{m}'s loss_type (default {LOSSES[m]})")
        ap.add_argument(f"--clip-{m}", type=float, default=0.0, help=f"{m}'s gradient_clip (default 0: off)")
        ap.add_argument(f"--schedule-{m}", default="constant", choices=SCHEDULES,
                        help=f"{m}'s rate: constant (default), or cosine (annealed per epoch from --lr-{m} to 0)")
    args = ap.parse_args(argv)
    given_methods = args.methods
    args.datasets, args.methods = _list(args.datasets), _list(args.methods or ",".join(RATES))
    args.batch_sizes = _list(args.batch_sizes, int)
    for name, given, valid in (("--datasets", args.datasets, DATASETS), ("--methods", args.methods, RATES)):
        bad = [v for v in given if v not in valid]
        if bad or not given:
            ap.error(f"{name}: each must be one of {', '.join(valid)}, got {bad or given}")
    for name in ("seeds", "epochs", "max_train", "threads", "jobs"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if not args.batch_sizes or min(args.batch_sizes) < 1:
        ap.error(f"--batch-sizes must be integers >= 1, got {args.batch_sizes}")
    args.rates = {m: getattr(args, f"lr_{m.replace('-', '_')}") for m in RATES}
    args.losses = {m: getattr(args, f"loss_{m.replace('-', '_')}") for m in LOSSES}
    args.clips = {m: getattr(args, f"clip_{m.replace('-', '_')}") for m in RATES}
    args.schedules = {m: getattr(args, f"schedule_{m.replace('-', '_')}") for m in RATES}
    bad_clips = {m: c for m, c in args.clips.items() if not (math.isfinite(c) and c >= 0)}
    if bad_clips:
        ap.error(f"--clip-<method> must be a finite number >= 0 (0: off), got {bad_clips}")
    if args.dry_run:
        args.datasets, args.seeds, args.epochs = ["digits"], 1, 1
        args.methods = args.methods if given_methods else ["bp-sgdm", "tween"]
    return args


def _load(names: list[str], max_train: int | None, device: str) -> dict[str, Split]:
    """Every requested data set, loaded before any training (a missing one stops the run at once)."""
    out = {}
    for name in names:
        xtr, ytr, xte, yte = standardise(DATASETS[name].load())
        if max_train:
            xtr, ytr = xtr[:max_train], ytr[:max_train]
        out[name] = tuple(t.to(device) for t in (xtr, ytr, xte, yte))
    return out


def _warm_up(split: Split, methods: list[str], args) -> None:
    """Each method once on two batches, untimed: the first optimizer's import of ``torch._dynamo``
    (~8 s here) and other one-time costs stay out of the first row's epoch time."""
    tiny = (split[0][:64], split[1][:64], split[2][:64], split[3][:64])
    for m in methods:
        run_one(m, tiny, 32, args.rates[m], args.losses[m], 1, 0, args.device, args.precision, args.clips[m], args.schedules[m])


def _row_runs(name: str, method: str, batch: int, lr: float, loss: str, epochs: int, seeds: list[int], args, split: Split | None = None) -> list[Run]:
    """Every seed of one row (stops at the first refusal: the same settings are refused at every seed)."""
    if split is None:  # in a worker process: the data set loaded once per worker
        if args.threads:
            torch.set_num_threads(args.threads)
        if name not in _WORKER_DATA:
            _WORKER_DATA[name] = _load([name], args.max_train, args.device)[name]
        split = _WORKER_DATA[name]
    runs = []
    for seed in seeds:
        runs.append(run_one(method, split, batch, lr, loss, epochs, seed, args.device, args.precision,
                            args.clips[method], args.schedules[method]))
        if runs[-1].refused:
            break
    return runs


_WORKER_DATA: dict[str, Split] = {}


def _rows_runs(tasks: list[tuple], split: Split, jobs: int):
    """The runs of each row of ``tasks``, in order: here one after the other, or ``jobs`` rows at a time
    in spawned worker processes (CUDA cannot be forked)."""
    if jobs <= 1:
        for task in tasks:
            yield _row_runs(*task, split=split)
        return
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    with ProcessPoolExecutor(max_workers=jobs, mp_context=multiprocessing.get_context("spawn")) as pool:
        # one task per seed of each row: five seeds of one slow row do not leave the other workers idle
        futures = [[pool.submit(_row_runs, *task[:6], [seed], task[7]) for seed in task[6]] for task in tasks]
        for row in futures:
            runs = [f.result()[0] for f in row]
            refused = next((r for r in runs if r.refused), None)
            yield [refused] if refused else runs


def main(argv=None) -> int:
    args = parse(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("bench_methods.py: --device cuda but CUDA is not available", file=sys.stderr)
        return 2
    try:
        data = _load(args.datasets, args.max_train, args.device)
    except DataMissing as e:
        print(f"bench_methods.py: {e}", file=sys.stderr)
        return 2
    dev_name = torch.cuda.get_device_name() if args.device == "cuda" else f"CPU ({os.cpu_count()} cores, {torch.get_num_threads()} threads)"
    print(f"# bench_methods.py on {dev_name}, torch {torch.__version__}, Python {platform.python_version()}, "
          f"{time.strftime('%Y-%m-%d %H:%M')}")
    print(f"command: python bench/bench_methods.py {' '.join(sys.argv[1:] if argv is None else argv)}".rstrip())
    seeds = list(range(args.seeds))
    _warm_up(next(iter(data.values())), args.methods, args)
    for name, split in data.items():
        spec, (xtr, ytr, xte, _) = DATASETS[name], split
        epochs, n_classes = args.epochs or spec.epochs, classes(split)
        print(f"\n## {spec.title}: {xtr.shape[1]}-256-256-{n_classes}, {len(ytr)} train / {len(xte)} test, "
              f"{epochs} epoch{'s' * (epochs > 1)}, seeds {seeds[0]}–{seeds[-1]}, precision {args.precision}\n", flush=True)
        if name == "fashion":
            print(ANCHORS + "\n")
        rows = [Row(m, batch, args.rates[m], args.losses[m], clip=args.clips[m], schedule=args.schedules[m])
                for batch in args.batch_sizes for m in args.methods]
        t0 = time.perf_counter()
        tasks = [(name, r.method, r.batch, r.lr, r.loss, epochs, seeds, args) for r in rows]
        for row, runs in zip(rows, _rows_runs(tasks, split, args.jobs)):
            row.runs = runs
            print(f"  {name} {row.method} batch {row.batch}: {row.cells(n_classes)[4]}  ({time.perf_counter() - t0:.0f} s)", file=sys.stderr, flush=True)
        print(table(HEADER, [r.cells(n_classes) for r in rows], args.markdown))
        lines = verdicts(name, rows, args.batch_sizes)
        if lines:
            print("\nTargets (one rate per method at every batch size; mean test accuracy, %):\n")
            print(table(["target", *(f"batch {b}" for b in args.batch_sizes)], lines, args.markdown), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
