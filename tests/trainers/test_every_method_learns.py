"""Every method learns (SPEC §8 revised, §15): one loss setting, rates that mean the same at every
batch size, and divergence that is never silent.

* TargetProp's chain rule with ``reduction="mean"`` (the default), momentum 0, no gate, no depth
  scaling and every budget 1 is exactly SGD on the **mean** of the chosen loss (cross-entropy or
  ½Σ(y − t)²), against plain torch autograd in float64, several networks and batch sizes;
* for every method, one step on a batch of B copies of a row equals one step on that row;
* ``loss_type`` means the same for every method: TargetProp trains on and logs cross-entropy, Tweening
  honours ``"mse"`` through ``train()``, conflicting or unusable losses are refused by name;
* a rate ×1000 gives a ``DivergenceWarning`` and ``diverged = 1`` in the history for every method,
  Tweening's dead-network collapse (digits, rate 0.05, batch 1) is reported, no monitor keeps a
  diverged epoch as its best, ``TerminateOnDivergence`` stops there.
"""

from __future__ import annotations

import copy
import math
import warnings

import pytest
import torch
import torch.nn.functional as F

import torchloom
from torchloom import (
    LSTM,
    Checkpoint,
    Dense,
    DivergenceWarning,
    EarlyStopping,
    LastStep,
    Network,
    TargetPropConfig,
    TargetPropState,
    TerminateOnDivergence,
    TrainingConfig,
    TweenConfig,
    apply_target_prop_gaps,
    target_prop_backward,
    target_prop_forward,
    train,
)
from test_examples import load_example

F64 = torch.float64


# ------------------------------------------------------------------------------------------------
# TargetProp's chain rule, averaged, is SGD on the mean loss


def _tp_as_sgd(net, batches, lr, loss_type):
    cfg = TargetPropConfig(momentum=0.0, gate_threshold=0.0, depth_scale_factor=1.0, learning_rate=lr, loss_type=loss_type)
    state = TargetPropState(net, cfg)
    for x, y in batches:
        target_prop_forward(net, state, x)
        target_prop_backward(net, state, y)
        state.calculate_link_budgets()
        state.link_budgets = [1.0] * len(state.link_budgets)
        apply_target_prop_gaps(net, state, lr)


def _sgd(net, forward, batches, lr, loss_type):
    """Plain torch autograd SGD on the batch mean of the loss (float64): the independent reference."""
    ref = copy.deepcopy(net)
    params = list(ref.parameters())
    for x, y in batches:
        out = forward(ref, x)
        if loss_type == "cross_entropy":
            loss = F.cross_entropy(out, y) if y.dtype == torch.long else -(y * out.log_softmax(-1)).sum(-1).mean()
        else:
            loss = 0.5 * ((out - y) ** 2).sum() / x.shape[0]
        grads = torch.autograd.grad(loss, params)
        with torch.no_grad():
            for p, g in zip(params, grads):
                p -= lr * g
    return ref


def _mlp():
    torch.manual_seed(3)
    return Network(Dense(4, 6, "tanh", dtype=F64), Dense(6, 5, "sigmoid", dtype=F64), Dense(5, 3, dtype=F64))


def _mlp_forward(net, x):
    h = torch.tanh(F.linear(x, net[0].weight, net[0].bias))
    h = torch.sigmoid(F.linear(h, net[1].weight, net[1].bias))
    return F.linear(h, net[2].weight, net[2].bias)


def _lstm():
    torch.manual_seed(4)
    return Network(LSTM(4, 5, dtype=F64), LastStep(), Dense(5, 3, dtype=F64))


def _lstm_forward(net, x):
    lstm = net[0]
    h = torch.zeros(x.shape[0], 5, dtype=F64)
    c = torch.zeros_like(h)
    for s in range(x.shape[1]):
        gates = x[:, s] @ lstm.weight_ih.T + h @ lstm.weight_hh.T + lstm.bias
        i, f, g, o = gates.chunk(4, dim=-1)
        c = torch.sigmoid(f) * c + torch.sigmoid(i) * torch.tanh(g)
        h = torch.sigmoid(o) * torch.tanh(c)
    return F.linear(h, net[2].weight, net[2].bias)


@pytest.mark.parametrize("loss_type", ["cross_entropy", "mse"])
@pytest.mark.parametrize("rows", [1, 5, 16])
@pytest.mark.parametrize("make, forward, shape", [(_mlp, _mlp_forward, (4,)), (_lstm, _lstm_forward, (3, 4))], ids=["mlp", "lstm"])
def test_chain_rule_averaged_is_sgd_on_the_mean_loss(make, forward, shape, rows, loss_type):
    g = torch.Generator().manual_seed(rows)
    labels = loss_type == "cross_entropy"
    batches = [(torch.randn(rows, *shape, generator=g, dtype=F64),
                torch.randint(0, 3, (rows,), generator=g) if labels else torch.randn(rows, 3, generator=g, dtype=F64))
               for _ in range(3)]
    net = make()
    if isinstance(net[0], LSTM):
        assert torch.allclose(net[0].bias, net[0].bias)  # (one bias vector: b_ih + b_hh folded, as the reference reads it)
    ref = _sgd(net, forward, batches, 0.2, loss_type)
    _tp_as_sgd(net, batches, 0.2, loss_type)
    for k, (p, r) in enumerate(zip(net.parameters(), ref.parameters())):
        torch.testing.assert_close(p, r, rtol=1e-10, atol=1e-13, msg=f"param {k}")


def test_cross_entropy_with_soft_targets_is_sgd_too():
    g = torch.Generator().manual_seed(9)
    batches = [(torch.randn(7, 4, generator=g, dtype=F64), torch.softmax(torch.randn(7, 3, generator=g, dtype=F64), -1)) for _ in range(2)]
    net = _mlp()
    ref = _sgd(net, _mlp_forward, batches, 0.3, "cross_entropy")
    _tp_as_sgd(net, batches, 0.3, "cross_entropy")
    for p, r in zip(net.parameters(), ref.parameters()):
        torch.testing.assert_close(p, r, rtol=1e-10, atol=1e-13)


def test_lomms_summed_step_is_the_mean_step_times_the_batch():
    """``reduction="sum"`` (Loom's) at rate r equals ``"mean"`` at rate r·B: the same rule, one scale."""
    g = torch.Generator().manual_seed(2)
    x, y = torch.randn(8, 4, generator=g, dtype=F64), torch.randint(0, 3, (8,), generator=g)
    a, b = _mlp(), _mlp()
    for net, cfg in ((a, TargetPropConfig(learning_rate=0.01, reduction="sum")), (b, TargetPropConfig(learning_rate=0.08))):
        train(net, [(x, y)], TrainingConfig(method=cfg, epochs=3, verbose=0))
    for p, q in zip(a.parameters(), b.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-12, atol=1e-14)


# ------------------------------------------------------------------------------------------------
# One rate, every batch size: a batch of B copies of a row steps as that row


METHODS = {
    "backprop": dict(loss_type="cross_entropy", optimizer="momentum", learning_rate=0.1),
    "tp-chain": dict(method=TargetPropConfig(learning_rate=0.1), loss_type="cross_entropy"),
    "tp-pure": dict(method=TargetPropConfig(mode="pure", learning_rate=0.1), loss_type="cross_entropy"),
    "tween": dict(method=TweenConfig(base_rate=0.1, gap_threshold=0.0), loss_type="cross_entropy"),
    "tween-mse": dict(method=TweenConfig(base_rate=0.1, gap_threshold=0.0), loss_type="mse"),
    "custom": dict(method=load_example("08_custom_method.py").FeedbackAlignment(seed=1), loss_type="cross_entropy", learning_rate=0.1),
    "feedback_alignment": dict(method="feedback_alignment", loss_type="cross_entropy", optimizer="momentum", learning_rate=0.1),
    "dfa": dict(method="dfa", loss_type="cross_entropy", optimizer="momentum", learning_rate=0.1),
    "sign_symmetry": dict(method="sign_symmetry", loss_type="cross_entropy", optimizer="momentum", learning_rate=0.1),
    "fast_proxy": dict(method="fast_proxy", loss_type="cross_entropy", optimizer="momentum", learning_rate=0.1),
}


def _cfg(name, **kw):
    return TrainingConfig(**{"epochs": 1, "verbose": 0, **copy.deepcopy(METHODS[name]), **kw})


@pytest.mark.parametrize("name", list(METHODS))
def test_a_batch_of_copies_steps_as_its_row(name):
    g = torch.Generator().manual_seed(5)
    rows = [(torch.randn(1, 4, generator=g, dtype=F64), torch.randint(0, 3, (1,), generator=g)) for _ in range(3)]
    one, many = _mlp(), _mlp()
    train(one, rows, _cfg(name, epochs=2))
    train(many, [(x.expand(12, 4).contiguous(), y.expand(12).contiguous()) for x, y in rows], _cfg(name, epochs=2))
    moved = max(float((p - q).abs().max()) for p, q in zip(one.parameters(), _mlp().parameters()))
    assert moved > 1e-4  # the steps really moved the weights
    for p, q in zip(one.parameters(), many.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-10, atol=1e-12)


# ------------------------------------------------------------------------------------------------
# One loss setting for every method


def _digits():
    pytest.importorskip("sklearn")
    from sklearn.datasets import load_digits

    d = load_digits()
    return torch.tensor(d.data / 16, dtype=torch.float32), torch.tensor(d.target)


def test_target_prop_trains_on_cross_entropy_and_logs_it():
    x, y = _digits()
    torch.manual_seed(0)
    net = Network(Dense(64, 32, "relu"), Dense(32, 10))
    before = copy.deepcopy(net)
    cfg = TrainingConfig(method="target_prop", loss_type="cross_entropy", learning_rate=0.1, epochs=6, batch_size=32,
                         validation_data=(x[1500:], y[1500:]), metrics=("accuracy",), verbose=0)
    r = train(net, (x[:1500], y[:1500]), cfg)
    with torch.no_grad():  # the first batch's logged loss is the pre-update cross-entropy
        first = F.cross_entropy(before(x[:32]), y[:32]).item()
    assert r.history["val_loss"][-1] == pytest.approx(F.cross_entropy(net(x[1500:]).detach(), y[1500:]).item(), rel=1e-6)
    assert r.loss_history[0] < first + 0.1 and r.loss_history[-1] < 0.6
    assert r.history["val_accuracy"][-1] > 0.85
    with pytest.raises(ValueError, match="cannot be used with TargetProp.*'mse', 'cross_entropy'"):
        TrainingConfig(method="target_prop", loss_type="crossentropy")
    with pytest.raises(ValueError, match="disagrees with the TargetPropConfig's loss_type='mse'"):
        TrainingConfig(method=TargetPropConfig(loss_type="mse"), loss_type="cross_entropy")
    with pytest.raises(ValueError, match="reduction must be one of 'mean', 'sum'"):
        TargetPropConfig(reduction="batch")


def test_tween_honours_the_loss_it_is_given():
    x, y = _digits()
    runs = {}
    for loss in ("mse", "cross_entropy"):
        torch.manual_seed(0)
        net = Network(Dense(64, 32, "relu"), Dense(32, 10))
        r = train(net, (x[:512], y[:512]), TrainingConfig(method="tween", loss_type=loss, epochs=1, batch_size=32, verbose=0,
                                                          validation_data=(x[1500:], y[1500:])))
        out = net(x[1500:]).detach()
        want = F.mse_loss(out, F.one_hot(y[1500:], 10).float()) if loss == "mse" else F.cross_entropy(out, y[1500:])
        assert r.history["val_loss"][-1] == pytest.approx(want.item(), rel=1e-5)
        runs[loss] = r.loss_history[0]
    assert runs["mse"] < 1.0 < runs["cross_entropy"]  # two different losses were trained and logged
    with pytest.raises(ValueError, match="disagrees with the TweenConfig's loss_type='cross_entropy'"):
        TrainingConfig(method=TweenConfig(loss_type="cross_entropy"), loss_type="crossentropy")


# ------------------------------------------------------------------------------------------------
# Divergence is never silent


@pytest.mark.parametrize("name", [n for n in METHODS if n != "tween-mse"])
def test_a_rate_a_thousand_times_too_high_is_reported(name):
    g = torch.Generator().manual_seed(6)
    data = [(torch.randn(16, 4, generator=g, dtype=F64) * 3, torch.randint(0, 3, (16,), generator=g)) for _ in range(6)]
    settings = copy.deepcopy(METHODS[name])
    method = settings.get("method")
    if isinstance(method, TargetPropConfig):
        method.learning_rate *= 1000
    elif isinstance(method, TweenConfig):
        method.base_rate *= 1000
        method.explosion_detection = False  # Tween's own watch would cut the rate: the engine's watch is tested here
    else:
        settings["learning_rate"] *= 1000
    net = _mlp()
    with pytest.warns(DivergenceWarning, match=r"epoch \d+ (diverged|: no batch counted)"):
        r = train(net, data, TrainingConfig(**{**settings, "epochs": 6, "verbose": 0}))
    assert 1.0 in r.history["diverged"]
    assert all(torch.isfinite(p).all() for p in net.parameters())


def test_the_same_runs_at_ordinary_rates_are_not_reported():
    g = torch.Generator().manual_seed(6)
    data = [(torch.randn(16, 4, generator=g, dtype=F64), torch.randint(0, 3, (16,), generator=g)) for _ in range(6)]
    for name in METHODS:
        with warnings.catch_warnings():
            warnings.simplefilter("error", DivergenceWarning)
            r = train(_mlp(), data, _cfg(name, epochs=6))
        assert r.history["diverged"] == [0.0] * 6


def test_tweens_dead_network_collapse_is_reported():
    """Tween at rate 0.05, batch 1, on digits: every ReLU of the hidden layer dies in the first epoch
    (accuracy at chance, the gaps small, no explosion): the epoch is reported as diverged."""
    x, y = _digits()
    torch.manual_seed(0)
    net = Network(Dense(64, 32, "relu"), Dense(32, 10))
    with pytest.warns(DivergenceWarning, match=r"epoch 1 diverged: layer 0 \(Dense\) passes no signal.*learning rate \(0.05\)"):
        r = train(net, (x[:1500], y[:1500]), TrainingConfig(method=TweenConfig(base_rate=0.05), loss_type="cross_entropy",
                                                            epochs=1, batch_size=1, verbose=0))
    assert r.history["diverged"] == [1.0]


def test_a_bounded_collapse_that_undoes_training_is_reported():
    """Tween at rate 0.5, batch 32, cross-entropy, on digits: no explosion and no dead layer at first,
    but the loss climbs back above its first epoch's (1.47 → 1.40 → 1.66 …) while the accuracy falls
    (54 % → 39 % …): every epoch from the one that climbs back is reported, the best never."""
    x, y = _digits()
    torch.manual_seed(0)
    net = Network(Dense(64, 64, "relu"), Dense(64, 64, "relu"), Dense(64, 10))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        r = train(net, (x, y), TrainingConfig(method="tween", learning_rate=0.5, loss_type="cross_entropy", epochs=4, batch_size=32, verbose=0, device="cpu"))
    loss, flags = r.history["loss"], r.history["diverged"]
    assert loss[-1] > 1.1 * loss[0]  # the collapse: training undid its progress, with no NaN and no blow-up
    assert flags[0] == 0.0 and flags[-1] == 1.0
    messages = [str(w.message) for w in caught if issubclass(w.category, DivergenceWarning)]
    assert any("training is undoing its progress" in m for m in messages)


@pytest.mark.parametrize("losses, flagged", [
    ([1.467, 1.398, 1.662, 1.70], [2, 3]),  # the measured collapse above
    ([1.0, 0.5, 0.52, 0.4, 0.45], []),  # wobbles below the first epoch: learning
    ([2.30, 2.30, 2.31, 2.30], []),  # flat at chance: not learning, but nothing undone
    ([1.0, 0.2, 0.9, 1.05], [3]),  # back above the start only at the end
])
def test_the_regression_rule_of_the_watch(losses, flagged):
    from torchloom.engine.divergence import DivergenceWatch

    watch = DivergenceWatch(10.0)
    got = [e for e, v in enumerate(losses) if watch.check(e, v, [], counted=True)]
    assert got == flagged


def test_monitors_never_keep_a_diverged_epoch_and_terminate_stops_there(tmp_path):
    """An epoch with a lower loss that the engine found diverged is not the best; TerminateOnDivergence
    stops at it. The divergence is staged with a rate schedule that jumps ×1e4 at epoch 3."""
    g = torch.Generator().manual_seed(6)
    data = [(torch.randn(16, 4, generator=g, dtype=F64), torch.randint(0, 3, (16,), generator=g)) for _ in range(4)]
    sched = lambda step: 0.05 if step < 8 else 500.0  # noqa: E731 - epochs 1-2 fine, then far too high

    class Collect:
        def __init__(self):
            self.logs = []

        def on_epoch_end(self, trainer, epoch, logs):
            self.logs.append(dict(logs))

    best, stop, stopper, seen = tmp_path / "best.pt", EarlyStopping(patience=10), TerminateOnDivergence(), Collect()
    with pytest.warns(DivergenceWarning):
        r = train(_mlp(), data, TrainingConfig(loss_type="cross_entropy", learning_rate=0.05, scheduler=sched, epochs=8, verbose=0,
                                               observers=[Checkpoint(best, monitor="loss"), stop, stopper, seen]))
    diverged = [e for e, logs in enumerate(seen.logs) if logs["diverged"]]
    assert diverged and stopper.stopped_epoch == diverged[0] and len(r.loss_history) == diverged[0] + 1
    assert stop.best_epoch is not None and stop.best_epoch < diverged[0]
    assert torch.load(best, weights_only=True)["epoch"] == stop.best_epoch + 1


def test_divergence_factor_is_checked_and_can_be_switched_off():
    with pytest.raises(ValueError, match="divergence_factor must be 0 \\(off\\) or a finite number > 1"):
        TrainingConfig(divergence_factor=0.5)
    with pytest.raises(ValueError, match="divergence_factor"):
        TrainingConfig(divergence_factor=math.inf)
    assert TrainingConfig(divergence_factor=0).divergence_factor == 0


def test_resume_keeps_the_watchs_best_loss(tmp_path):
    g = torch.Generator().manual_seed(6)
    data = [(torch.randn(16, 4, generator=g, dtype=F64), torch.randint(0, 3, (16,), generator=g)) for _ in range(4)]
    sched = lambda step: 0.05 if step < 8 else 500.0  # noqa: E731 - epochs 3 and 4 blow up
    base = dict(loss_type="cross_entropy", learning_rate=0.05, scheduler=sched, verbose=0)
    path = tmp_path / "run.pt"
    train(_mlp(), data, TrainingConfig(epochs=2, observers=[Checkpoint(path, save_best_only=False)], **base))
    saved = torch.load(path, weights_only=True)["divergence"]
    assert saved["best_epoch"] in (0, 1) and math.isfinite(saved["best"]) and math.isfinite(saved["first"]) and saved["start_norm"] > 0
    with pytest.warns(DivergenceWarning, match=r"epoch 3 diverged: the loss grew from [\d.]+ \(its first epoch\)"):
        resumed = train(_mlp(), data, TrainingConfig(epochs=4, resume_from=path, **base))
    with pytest.warns(DivergenceWarning):
        whole = train(_mlp(), data, TrainingConfig(epochs=4, **base))
    assert resumed.history["diverged"] == whole.history["diverged"] == [0.0, 0.0, 1.0, 1.0]


@pytest.mark.cuda
@pytest.mark.parametrize("name", ["tp-chain", "tp-pure", "tween-mse", "custom"])
def test_cuda_device_path_equals_the_cpu(name):
    """The averaged, cross-entropy (or one-hot MSE) steps on the CUDA device path (graph-captured)
    give the CPU's numbers."""
    g = torch.Generator().manual_seed(7)
    data = [(torch.randn(32, 4, generator=g), torch.randint(0, 3, (32,), generator=g)) for _ in range(5)]
    runs = []
    for device in ("cpu", "cuda"):
        torch.manual_seed(3)
        net = Network(Dense(4, 16, "tanh"), Dense(16, 3))
        runs.append(train(net, data, _cfg(name, epochs=4, device=device)).loss_history)
    assert runs[1] == pytest.approx(runs[0], rel=1e-4)


@pytest.mark.parametrize("name", ["backprop", "tp-chain", "tween"])
def test_an_epoch_with_most_batches_skipped_is_diverged_not_a_success(name, tmp_path):
    """15 of 16 batches NaN: the one good batch makes the epoch's loss, so the epoch is reported as
    diverged and no monitor keeps it (a run that skipped 4,095 of 4,096 batches once reported 0.0)."""
    g = torch.Generator().manual_seed(8)
    good = [(torch.randn(4, 4, generator=g, dtype=F64), torch.randint(0, 3, (4,), generator=g)) for _ in range(16)]
    bad = [(torch.full_like(x, math.nan), y) if k else (x, y) for k, (x, y) in enumerate(good)]
    best = tmp_path / "best.pt"
    net = _mlp()
    train(net, good, _cfg(name, epochs=1))  # an ordinary first epoch
    with pytest.warns(DivergenceWarning, match=r"epoch 1 diverged: 15 of its 16 batches were skipped"):
        r = train(net, bad, _cfg(name, epochs=1, observers=[Checkpoint(best, monitor="loss")]))
    assert r.history["diverged"] == [1.0] and r.skipped_batches == 15
    assert not best.exists()  # never saved as the best
