"""Tweening's explosion watch on real training: the measured promises on small, fast cases, the
watch fields and their per-epoch means, the device form of the rule, and a config re-checked when
training starts or a step runs.

The full-size measurements are in bench/bench_tween_quality.py (bench/RESULTS.md). References here
are independent: torch.optim.SGD on plain autograd for the baseline, a recomputation of per-epoch
means from the per-step observer logs, and the host step for the device step.
"""

from __future__ import annotations

import gzip
import math
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from helpers import assert_close
from torchloom import TrainingConfig
from torchloom.layers.dense import Dense
from torchloom.layers.network import Network
from torchloom import TweenConfig, TweenState, TweenTrainer

FASHION_DIR = Path("/usr/share/datasets/fashion-mnist")


@pytest.fixture(scope="module")
def digits():
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    d = load_digits()
    xtr, xte, ytr, yte = train_test_split(d.data / 16.0, d.target, test_size=0.25, random_state=0, stratify=d.target)
    f = lambda a: torch.tensor(a, dtype=torch.float32)
    return f(xtr), torch.tensor(ytr), f(xte), torch.tensor(yte)


@pytest.fixture(scope="module")
def fashion():
    names = ("train-images-idx3-ubyte.gz", "train-labels-idx1-ubyte.gz")
    if not all((FASHION_DIR / n).is_file() for n in names):
        pytest.skip(f"Fashion-MNIST not installed in {FASHION_DIR} (Debian package dataset-fashion-mnist)")

    def read(name, offset):
        with gzip.open(FASHION_DIR / name) as f:
            return np.frombuffer(f.read(), np.uint8, offset=offset)

    x = torch.tensor(read(names[0], 16).reshape(-1, 784)[:2000] / 255.0, dtype=torch.float32)
    y = torch.tensor(read(names[1], 8)[:2000].astype(np.int64))
    return x, y


def _net(sizes, seed):
    torch.manual_seed(seed)
    return Network(*[Dense(a, b, "relu") for a, b in zip(sizes[:-2], sizes[1:-1])], Dense(sizes[-2], sizes[-1]))


def _epochs(state, net, x, y, epochs, batch, seed):
    g = torch.Generator().manual_seed(seed)
    for _ in range(epochs):
        perm = torch.randperm(len(y), generator=g)
        for i in range(0, len(perm), batch):
            idx = perm[i : i + batch]
            state.step(net, x[idx], y[idx])


@torch.no_grad()
def _acc(net, x, y):
    return float((net(x).argmax(1) == y).double().mean())


# ------------------------------------------------------------------------------ no false alarms
@pytest.mark.parametrize("base_rate", [0.01, None], ids=["document-rate", "default-rate"])
@pytest.mark.parametrize("batch, epochs", [(1, 2), (32, 20)])
def test_no_false_alarms_digits(digits, batch, epochs, base_rate):
    """At the Tweening document's rate and at the default (base_rate=None: 0.03 × min(1, B/16)), online
    and in batches: no explosion in ordinary training, the adaptive rate never cut, and it learns."""
    xtr, ytr, xte, yte = digits
    for seed in range(2):
        net = _net((64, 32, 10), seed)
        state = TweenState(net, TweenConfig(base_rate=base_rate))
        _epochs(state, net, xtr, ytr, epochs, batch, seed)
        assert state.explosion_count == 0, f"seed {seed}: {state.explosion_count} explosions in ordinary training"
        assert state.adaptive_rate == (base_rate or 0.03) and _acc(net, xte, yte) > 0.85


@pytest.mark.parametrize("batch, epochs", [(1, 1), (32, 5)])
def test_no_false_alarms_fashion_mnist(fashion, batch, epochs):
    x, y = fashion
    net = _net((784, 256, 10), 0)
    state = TweenState(net, TweenConfig())
    _epochs(state, net, x, y, epochs, batch, 0)
    assert state.explosion_count == 0, f"{state.explosion_count} explosions in ordinary training"
    assert _acc(net, x, y) > 0.3  # it learned (chance is 0.1; online at rate 0.01 is noisy on this data)


# ------------------------------------------------------------------------------ real explosions
@pytest.mark.parametrize("fault", ["last layer x50", "lr x1000"])
def test_injected_fault_is_caught_within_3_steps(digits, fault):
    xtr, ytr, _, _ = digits
    for seed in range(2):
        net = _net((64, 32, 10), seed)
        state = TweenState(net, TweenConfig(base_rate=0.01))  # the document's rate
        _epochs(state, net, xtr, ytr, 3, 16, seed)
        assert state.explosion_count == 0
        if fault == "last layer x50":
            with torch.no_grad():
                net.layers[-1].weight.mul_(50.0)
        g = torch.Generator().manual_seed(99 + seed)
        detected = None
        for k in range(3):
            idx = torch.randperm(len(ytr), generator=g)[:16]
            if fault == "lr x1000":  # the step runs at 1000 × the rate (rate ceiling and adaptive rate)
                state.adaptive_rate = 10.0
            rate_before = state.adaptive_rate
            state.step(net, xtr[idx], ytr[idx], rate=10.0 if fault == "lr x1000" else None)
            if state.explosion_count and detected is None:
                detected = k + 1
                assert state.gap_growth_rate > 10
                assert state.adaptive_rate == pytest.approx(0.5 * rate_before, rel=1e-12), "the rate must be cut"
        assert detected is not None, f"seed {seed}: {fault} not detected within 3 steps"


# ------------------------------------------------------------------------------- task switch
def _stream(method, net, x, y, perm_labels, n_a, n_b, seed, window=100):
    g = torch.Generator().manual_seed(seed)
    order = torch.cat([torch.randperm(len(y), generator=g) for _ in range((n_a + n_b) // len(y) + 1)])
    windows, hits = [], 0
    for j in range(n_a + n_b):
        k = int(order[j])
        xi, yi = x[k : k + 1], y[k : k + 1]
        if j >= n_a:
            yi = perm_labels[yi]
        with torch.no_grad():
            hits += int(net(xi).argmax(1).item() == yi.item())
        method(xi, yi)
        if (j + 1) % window == 0:
            windows.append(hits / window)
            hits = 0
    na = n_a // window
    pre = sum(windows[na - 3 : na]) / 3
    back = next(w for w, a in enumerate(windows[na:]) if a >= 0.8 * pre)
    return pre, (back + 1) * window


def test_task_switch_never_freezes_and_recovers_like_sgd(digits):
    """Labels permuted mid-stream (online, batch 1): Tween's rate never collapses and its accuracy on
    the new task comes back to 80 % of the pre-switch level about as fast as SGD with momentum's."""
    xtr, ytr, xte, yte = digits
    perm_labels = torch.tensor([3, 7, 5, 9, 0, 2, 8, 1, 4, 6])
    rec_tween, rec_sgd = [], []
    for seed in range(2):
        net = _net((64, 32, 10), seed)
        state = TweenState(net, TweenConfig())
        rates = []

        def tween(xi, yi):
            state.step(net, xi, yi)
            rates.append(state.adaptive_rate)

        _, rec = _stream(tween, net, xtr, ytr, perm_labels, 1200, 1200, seed)
        rec_tween.append(rec)
        assert min(rates[1200:]) >= 0.01 * 0.01, "adaptive_rate fell below its floor"
        assert sum(r < 0.005 for r in rates[1200:]) <= 100, "the rate stayed cut for long after the switch"
        assert _acc(net, xte, perm_labels[yte]) > 0.6

        net = _net((64, 32, 10), seed)
        opt = torch.optim.SGD(net.parameters(), lr=0.01, momentum=0.9)

        def sgd(xi, yi):
            opt.zero_grad()
            F.cross_entropy(net(xi), yi).backward()
            opt.step()

        rec_sgd.append(_stream(sgd, net, xtr, ytr, perm_labels, 1200, 1200, seed)[1])
    assert sum(rec_tween) <= sum(rec_sgd) + 200, f"Tween {rec_tween} vs SGD+momentum {rec_sgd} samples to 80 %"


# ----------------------------------------------------------------------------- watch fields
def test_watch_fields_and_per_epoch_means_in_history():
    torch.manual_seed(0)
    net = Network(Dense(4, 6, "tanh", dtype=torch.float64), Dense(6, 2, dtype=torch.float64))
    g = torch.Generator().manual_seed(1)
    data = [(torch.randn(5, 4, generator=g, dtype=torch.float64), torch.randn(5, 2, generator=g, dtype=torch.float64) * 0.1)
            for _ in range(14)]
    data[12] = (data[12][0], data[12][1] + 100.0)  # one blow-up after the warm-up
    seen = []

    class Watch:
        def on_batch_end(self, trainer, step, logs):
            seen.append(dict(logs))

    trainer = TweenTrainer(net, TweenConfig(base_rate=0.02, gap_threshold=0.0), observers=[Watch()])
    result = trainer.fit(data, epochs=2)
    st = trainer.state
    assert st.explosion_count >= 1 and st.explosion_history[12] == 1
    assert st.gap_baseline > 0 and st.gap_growth_rate > 0 and 0 < st.adaptive_rate <= 0.02
    for key in ("gap_baseline", "explosion_count", "adaptive_rate", "explosion"):
        for epoch in range(2):
            want = sum(s[key] for s in seen[14 * epoch : 14 * (epoch + 1)]) / 14
            assert result.history[key][epoch] == pytest.approx(want, rel=1e-12), key
    assert [s["explosion_count"] for s in seen] == [float(c) for c in st.explosion_history]
    assert [s["adaptive_rate"] for s in seen] == st.rate_history
    assert seen[-1]["gap_baseline"] == st.gap_baseline


def test_device_rule_equals_host_rule_through_explosions():
    """The engine's device step (run on CPU tensors by its runner) makes the same explosion decisions
    and leaves the same watch state as the host step."""
    from torchloom.engine.cuda_path import CudaRunner
    from torchloom.engine.train import make_trainer

    g = torch.Generator().manual_seed(4)
    data = [(torch.randn(6, 4, generator=g, dtype=torch.float64), 0.1 * torch.randn(6, 2, generator=g, dtype=torch.float64))
            for _ in range(16)]
    for k in (11, 12, 13, 14):  # a blow-up that lasts: explosions, then the baseline adapts
        data[k] = (data[k][0], data[k][1] + 30.0)

    def cfg():
        return TrainingConfig(method=TweenConfig(base_rate=0.02, gap_threshold=0.0), epochs=3, verbose=0, loss_type="mse")

    def net():
        torch.manual_seed(0)
        return Network(Dense(4, 8, "tanh", dtype=torch.float64), Dense(8, 2, dtype=torch.float64))

    a, b = net(), net()
    ta = make_trainer(a, cfg())
    ra = ta.fit(data, 3)  # the host step
    tb = make_trainer(b, cfg())
    tb._runner = CudaRunner(tb)
    rb = tb.fit(data, 3)
    assert ra.history["explosion_count"][-1] > 0, "the case must contain explosions"
    for key in ("explosion", "explosion_count", "gap_baseline", "adaptive_rate", "mean_gap"):
        np.testing.assert_allclose(rb.history[key], ra.history[key], rtol=1e-9, err_msg=key)
    for p, q in zip(b.parameters(), a.parameters()):
        assert_close(p, q, name="param", rtol=1e-10, atol=1e-12)
    sa, sb = ta.state, tb.state
    for key in ("explosion_count", "adaptive_rate", "gap_baseline", "gap_growth_rate", "gap_log_mean", "gap_log_dev",
                "gap_log_peak", "explosion_pressure", "steps"):
        assert getattr(sa, key) == pytest.approx(getattr(sb, key), rel=1e-9), key


# -------------------------------------------------------------------- config changed later
def test_config_changed_after_construction_is_rechecked():
    net = Network(Dense(3, 2, dtype=torch.float64))
    cfg = TweenConfig()
    state = TweenState(net, cfg)
    trainer = TweenTrainer(net, cfg)
    before = [p.detach().clone() for p in net.parameters()]
    cfg.base_rate = -0.5
    x, y = torch.randn(4, 3, dtype=torch.float64), torch.randn(4, 2, dtype=torch.float64)
    with pytest.raises(ValueError, match=r"TweenConfig: base_rate must be .* got -0.5"):
        TweenState(net, cfg)
    with pytest.raises(ValueError, match="base_rate"):
        state.tween_step(net, x, y)
    with pytest.raises(ValueError, match="base_rate"):
        state.step(net, x, y)
    with pytest.raises(ValueError, match="base_rate"):
        trainer.fit([(x, y)], epochs=1)
    with pytest.raises(ValueError, match="base_rate"):
        cfg.validate()
    assert state.steps == 0 and trainer.state.steps == 0 and state.loss_history == []
    assert all(torch.equal(p, q) for p, q in zip(net.parameters(), before))
    cfg.base_rate, cfg.explosion_detection = 0.01, "yes"
    with pytest.raises(TypeError, match="explosion_detection"):
        state.tween_step(net, x, y)
    cfg.explosion_detection, cfg.explosion_limit = True, math.nan
    with pytest.raises(ValueError, match="explosion_limit"):
        trainer.fit([(x, y)], epochs=1)
    assert all(torch.equal(p, q) for p, q in zip(net.parameters(), before))
