"""One training engine for every method: ``train(..., TrainingConfig(method=...))``.

* ``train`` with a method config gives bit for bit what the trainer classes' ``fit`` gives (they are
  thin wrappers over the same engine);
* every ``TrainingConfig`` feature works for every method (one parametrised test per feature);
* the device step of a method, run by the engine's runner (on CPU tensors here, kernels on their
  references), gives the host step's numbers; on CUDA the same holds with and without graphs.
"""

import copy
import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

from helpers import assert_close
from torchloom import (
    DFAConfig,
    Dense,
    FastProxyConfig,
    FeedbackAlignmentConfig,
    SignSymmetryConfig,
    DivergenceWarning,
    Network,
    TargetPropConfig,
    TargetPropTrainer,
    TrainingConfig,
    TweenConfig,
    TweenTrainer,
    train,
)
from torchloom.engine.cuda_path import CudaRunner
from test_examples import load_example

METHODS = {
    "backprop": "backprop",
    "tp-chain": TargetPropConfig(learning_rate=0.05, gate_threshold=0.3),
    "tp-pure": TargetPropConfig(mode="pure", learning_rate=0.02),
    "tween": TweenConfig(base_rate=0.05),
    # a rule written outside torchloom (examples/08_custom_method.py): every engine feature applies to it too
    "custom": load_example("08_custom_method.py").FeedbackAlignment(seed=4),
    # the feedback rules (tests/trainers/test_zoo.py): backprop's machinery with their own backward
    "feedback_alignment": FeedbackAlignmentConfig(seed=4),
    "dfa": DFAConfig(seed=4),
    "sign_symmetry": SignSymmetryConfig(),
    "fast_proxy": FastProxyConfig(),
}
GRADIENT_RULES = ("backprop", "custom", "feedback_alignment", "dfa", "sign_symmetry", "fast_proxy")  # rules on backprop's machinery: an optimizer, a loss_type


def _net(dtype=torch.float64, seed=0, sizes=(6, 12, 4), acts=("tanh", "sigmoid")):
    torch.manual_seed(seed)
    layers = [Dense(a, b, f, dtype=dtype) for a, b, f in zip(sizes[:-1], sizes[1:], acts)]
    return Network(*layers)


def _data(n=5, bs=6, classes=4, dtype=torch.float64, seed=1, labels=True):
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        x = torch.randn(bs, 6, generator=g, dtype=dtype)
        y = torch.randint(0, classes, (bs,), generator=g) if labels else torch.rand(bs, classes, generator=g, dtype=dtype)
        out.append((x, y))
    return out


def _cfg(name, **kw):
    method = copy.deepcopy(METHODS[name])
    loss = "cross_entropy" if name in GRADIENT_RULES else "mse"
    return TrainingConfig(**{"method": method, "epochs": 3, "verbose": 0, "loss_type": loss, **kw})


def _same(a, b):
    return all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))


# --------------------------------------------------------------------- train() == trainer classes
@pytest.mark.parametrize(
    "method",
    [
        TargetPropConfig(),
        TargetPropConfig(mode="pure", learning_rate=0.03, momentum=0.5),
        TargetPropConfig(gate_threshold=0.6, depth_scale_factor=1.3),
        TweenConfig(),
        TweenConfig(base_rate=0.1, momentum_decay=0.5, depth_scaling=False),
        TweenConfig(gap_threshold=0.0, link_budget_scale=0.0),
    ],
    ids=["tp", "tp-pure", "tp-gated", "tween", "tween-fast", "tween-plain"],
)
@pytest.mark.parametrize("arch", [((6, 12, 4), ("tanh", "sigmoid")), ((6, 9, 7, 4), ("relu", "tanh", "linear"))], ids=["2-layer", "3-layer"])
def test_train_method_equals_trainer_fit_bit_for_bit(method, arch):
    sizes, acts = arch
    data = _data()
    a, b = _net(sizes=sizes, acts=acts), _net(sizes=sizes, acts=acts)
    ra = train(a, data, TrainingConfig(method=copy.deepcopy(method), epochs=3, verbose=0))
    cls = TargetPropTrainer if isinstance(method, TargetPropConfig) else TweenTrainer
    rb = cls(b, copy.deepcopy(method)).fit(data, 3)
    assert ra.loss_history == rb.loss_history
    assert _same(a, b)
    assert ra.history.epochs == rb.history.epochs


def test_method_by_name_uses_learning_rate_as_the_rate():
    data = _data()
    for name, cls, cfg in (("target_prop", TargetPropTrainer, TargetPropConfig(learning_rate=0.07)), ("tween", TweenTrainer, TweenConfig(base_rate=0.07))):
        a, b = _net(), _net()
        ra = train(a, data, TrainingConfig(method=name, learning_rate=0.07, epochs=2, verbose=0))
        rb = cls(b, cfg).fit(data, 2)
        assert ra.loss_history == rb.loss_history and _same(a, b), name


@pytest.mark.parametrize(
    "kwargs,exc,match",
    [
        (dict(method="newton"), ValueError, "unknown method 'newton'"),
        (dict(method=3), TypeError, "method must be"),
        (dict(method=TweenConfig(base_rate=0.2), learning_rate=0.5), ValueError, "disagrees with the method config's base_rate"),
        (dict(method=TargetPropConfig(learning_rate=0.2), learning_rate=0.5), ValueError, "disagrees with the method config's learning_rate"),
        (dict(method="tween", optimizer="adamw"), ValueError, "own momentum rule"),
    ],
)
def test_bad_method_settings(kwargs, exc, match):
    with pytest.raises(exc, match=match):
        TrainingConfig(**kwargs)


def test_method_config_changed_after_construction_is_rechecked():
    net = _net()
    before = copy.deepcopy(net)
    cfg = TrainingConfig(method=TargetPropConfig(), epochs=1, verbose=0)
    cfg.method.momentum = 1.5
    with pytest.raises(ValueError, match="momentum"):
        train(net, _data(), cfg)
    assert _same(net, before)


# ------------------------------------------------------------------ every feature, every method
@pytest.mark.parametrize("name", list(METHODS))
def test_observers_see_every_hook_with_method_logs(name):
    class Recorder:
        def __init__(self):
            self.calls, self.epoch_logs = [], []

        def on_train_begin(self, trainer):
            self.calls.append("train_begin")

        def on_batch_end(self, trainer, step, logs):
            self.calls.append("batch")
            assert math.isfinite(logs["loss"])

        def on_epoch_end(self, trainer, epoch, logs):
            self.epoch_logs.append(dict(logs))

        def on_train_end(self, trainer, result):
            self.calls.append("train_end")

    rec = Recorder()
    result = train(_net(), _data(), _cfg(name, observers=[rec]))
    assert rec.calls[0] == "train_begin" and rec.calls[-1] == "train_end" and rec.calls.count("batch") == 15
    assert len(rec.epoch_logs) == 3 and [e["loss"] for e in rec.epoch_logs] == result.loss_history
    expected = {"backprop": set(), "custom": set(), "feedback_alignment": set(), "dfa": set(), "sign_symmetry": set(),
                "fast_proxy": set(), "tp-chain": {"mean_link_budget", "mean_gap"}, "tp-pure": {"mean_link_budget", "mean_gap"},
                "tween": {"mean_gap", "mean_link_budget", "adaptive_rate"}}[name]
    assert expected <= set(rec.epoch_logs[0])
    assert expected <= set(result.history.keys())


@pytest.mark.parametrize("name", list(METHODS))
def test_verbose_levels(name, capsys):
    train(_net(), _data(), _cfg(name, verbose=2))
    lines = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("Epoch ")]
    assert [ln.split(" - ")[0] for ln in lines] == ["Epoch 1/3", "Epoch 2/3", "Epoch 3/3"]
    train(_net(), _data(), _cfg(name, verbose=0))
    assert capsys.readouterr().out == ""


@pytest.mark.parametrize("name", list(METHODS))
def test_seed_makes_runs_reproducible(name):
    torch.manual_seed(123)
    a = _net()
    ra = train(a, _data(), _cfg(name, seed=7))
    after_a = torch.rand(3)
    b = _net()
    rb = train(b, _data(), _cfg(name, seed=7))
    after_b = torch.rand(3)
    assert ra.loss_history == rb.loss_history and _same(a, b) and torch.equal(after_a, after_b)


@pytest.mark.parametrize("name", [n for n in METHODS if n not in GRADIENT_RULES])
def test_schedule_drives_the_method_rate(name):
    """A schedule constant at r equals the method configured with rate r; a decaying one differs."""
    data = _data()
    method = copy.deepcopy(METHODS[name])
    rate_field = "base_rate" if isinstance(method, TweenConfig) else "learning_rate"
    ref_method = copy.deepcopy(method)
    setattr(ref_method, rate_field, 0.011)
    a, b, c = _net(), _net(), _net()
    ra = train(a, data, TrainingConfig(method=method, epochs=2, verbose=0, scheduler=lambda step: 0.011))
    rb = train(b, data, TrainingConfig(method=ref_method, epochs=2, verbose=0))
    assert ra.loss_history == rb.loss_history and _same(a, b)
    rc = train(c, data, TrainingConfig(method=copy.deepcopy(method), epochs=2, verbose=0, scheduler=lambda step: 0.05 / (1 + step)))
    assert rc.loss_history[0] == ra.loss_history[0] or not _same(a, c)
    assert not _same(a, c)


@pytest.mark.parametrize("name", list(METHODS))
@pytest.mark.parametrize("mode", ["norm", "value"])
def test_clipping_bounds_the_update(name, mode):
    """A tiny clip keeps every step's update tiny; without it the weights move much further."""
    data = _data(n=2)
    a, b, ref = _net(), _net(), _net()
    train(a, data, _cfg(name, epochs=1, gradient_clip=1e-7, clip_mode=mode))
    train(b, data, _cfg(name, epochs=1))
    moved_clipped = max((p - q).abs().max().item() for p, q in zip(a.parameters(), ref.parameters()))
    moved_free = max((p - q).abs().max().item() for p, q in zip(b.parameters(), ref.parameters()))
    assert moved_clipped < 1e-5 and moved_free > 100 * moved_clipped


@pytest.mark.parametrize("name", list(METHODS))
def test_nan_batches_are_skipped_and_all_skipped_epochs_read_nan(name):
    data = _data()
    bad = [(x.clone(), y) for x, y in data]
    bad[1][0][0, 0] = float("nan")
    net = _net()
    result = train(net, bad, _cfg(name))
    assert all(torch.isfinite(p).all() for p in net.parameters())
    assert result.skipped_batches >= 3 and all(math.isfinite(v) for v in result.loss_history)
    all_bad = [(torch.full_like(x, float("nan")), y) for x, y in data]
    net2, before = _net(), _net()
    with pytest.warns(DivergenceWarning, match="no batch counted"):
        r2 = train(net2, all_bad, _cfg(name))
    assert all(math.isnan(v) for v in r2.loss_history) and r2.skipped_per_epoch == [5, 5, 5]
    assert _same(net2, before)


@pytest.mark.parametrize("name", list(METHODS))
def test_overflowing_updates_are_undone(name):
    """A rate so large that the update overflows float32: the weights are put back, never ±Inf/NaN."""
    data = [(x.float() * 1e3, y) for x, y in _data()]
    net = _net(torch.float32, acts=("linear", "linear"))  # gradients ~1e3: rate·gradient overflows
    before = copy.deepcopy(net)
    kw = dict(learning_rate=1e37) if name in GRADIENT_RULES else {}
    method = copy.deepcopy(METHODS[name])
    if isinstance(method, TweenConfig):
        method.base_rate = 1e37
    elif isinstance(method, TargetPropConfig):
        method.learning_rate = 1e37
    cfg = TrainingConfig(method=method, epochs=1, verbose=0, loss_type="cross_entropy" if name in GRADIENT_RULES else "mse", **kw)
    with pytest.warns(DivergenceWarning):
        result = train(net, data, cfg)
    assert all(torch.isfinite(p).all() for p in net.parameters())
    assert result.skipped_batches == 5 and _same(net, before)


@pytest.mark.parametrize("name", list(METHODS))
def test_frozen_parameters_are_never_updated(name):
    net = _net()
    net[0].weight.requires_grad_(False)
    frozen = net[0].weight.detach().clone()
    other = net[1].weight.detach().clone()
    train(net, _data(), _cfg(name))
    assert torch.equal(net[0].weight, frozen)
    assert not torch.equal(net[1].weight, other)


@pytest.mark.parametrize("name", list(METHODS))
def test_dataloader_data_and_result_type(name):
    xs = torch.cat([x for x, _ in _data()])
    ys = torch.cat([y for _, y in _data()])
    loader = DataLoader(TensorDataset(xs, ys), batch_size=6)
    a, b = _net(), _net()
    ra = train(a, loader, _cfg(name))
    rb = train(b, _data(), _cfg(name))
    assert ra.loss_history == rb.loss_history and _same(a, b)
    assert len(ra.epoch_times) == 3 and ra.samples_per_second > 0 and ra.skipped_per_epoch == [0, 0, 0]


@pytest.mark.parametrize("name", list(METHODS))
def test_bad_streamed_batch_restores_the_model(name):
    class Broken(torch.utils.data.Dataset):
        def __len__(self):
            return 12

        def __getitem__(self, i):
            x = torch.randn(6 if i < 8 else 5, dtype=torch.float64)
            return x, torch.tensor(i % 4)

    net, before = _net(), _net()
    with pytest.raises(ValueError, match="batch 2"):
        train(net, DataLoader(Broken(), batch_size=4), _cfg(name))
    assert _same(net, before)


# --------------------------------------------------------------------- device step == host step
def _forced(net, data, cfg):
    """The engine's device runner on a CPU trainer: the device step with every decision in tensors."""
    from torchloom.engine.train import make_trainer

    trainer = make_trainer(net, cfg)
    trainer._runner = CudaRunner(trainer)
    return trainer.fit(data, cfg.epochs), trainer


DEVICE_METHODS = ["tp-chain", "tp-pure", "tween"]


@pytest.mark.parametrize("name", DEVICE_METHODS)
@pytest.mark.parametrize(
    "extra",
    [dict(), dict(gradient_clip=0.05), dict(gradient_clip=0.01, clip_mode="value"), dict(scheduler=lambda s: 0.05 / (1 + s))],
    ids=["plain", "norm-clip", "value-clip", "schedule"],
)
def test_device_step_equals_host_step(name, extra):
    data = _data()
    a, b = _net(), _net()
    ra = train(a, data, _cfg(name, **extra))
    rb, _ = _forced(b, data, _cfg(name, **extra))
    np.testing.assert_allclose(rb.loss_history, ra.loss_history, rtol=1e-6)  # per-step losses kept in float32
    for p, q in zip(b.parameters(), a.parameters()):
        assert_close(p, q, name="param", rtol=1e-12, atol=1e-12)
    for key in ra.history.keys():
        if key in ("epoch_time", "samples_per_second", "eta"):
            continue
        np.testing.assert_allclose(rb.history[key], ra.history[key], rtol=1e-6, err_msg=key)


@pytest.mark.parametrize("name", DEVICE_METHODS)
def test_device_step_guards_match_host(name):
    data = _data()
    data[2] = (data[2][0].clone(), data[2][1])
    data[2][0][1, 2] = float("inf")
    a, b = _net(), _net()
    ra = train(a, data, _cfg(name))
    rb, _ = _forced(b, data, _cfg(name))
    assert ra.skipped_per_epoch == rb.skipped_per_epoch
    np.testing.assert_allclose(rb.loss_history, ra.loss_history, rtol=1e-6)
    for p, q in zip(b.parameters(), a.parameters()):
        assert_close(p, q, name="param", rtol=1e-12, atol=1e-12)


@pytest.mark.cuda
@pytest.mark.parametrize("name", list(METHODS))
@pytest.mark.parametrize("cuda_graph", [None, False])
def test_cuda_equals_cpu_for_every_method(name, cuda_graph):
    data = _data(n=7, dtype=torch.float32)
    a, b = _net(torch.float32), _net(torch.float32)
    ra = train(a, data, _cfg(name, epochs=3))
    rb = train(b, data, _cfg(name, epochs=3, use_gpu=True, cuda_graph=cuda_graph))
    np.testing.assert_allclose(rb.loss_history, ra.loss_history, rtol=5e-5)
    for p, q in zip(b.parameters(), a.parameters()):
        assert p.is_cuda
        assert_close(p.cpu(), q, name="param", rtol=5e-4, atol=5e-5)


# ------------------------------------------------------------------------------ exact resume
@pytest.mark.parametrize("name", list(METHODS))
def test_two_epochs_plus_resume_equals_four_epochs_bit_for_bit(name, tmp_path):
    from torchloom import Checkpoint

    data = _data()
    extra = dict(scheduler=lambda step: 0.05 / (1 + 0.1 * step)) if name not in GRADIENT_RULES else dict(optimizer="adamw", scheduler=lambda step: 0.01 / (1 + step))
    full = _net()
    r_full = train(full, data, _cfg(name, epochs=4, **extra))
    path = tmp_path / "run.pt"
    first = _net()
    train(first, data, _cfg(name, epochs=2, observers=[Checkpoint(path, save_best_only=False)], **extra))
    resumed = _net(seed=99)  # other initial weights: everything must come from the checkpoint
    r_res = train(resumed, data, _cfg(name, epochs=4, resume_from=path, **extra))
    assert _same(resumed, full)
    assert r_res.loss_history == r_full.loss_history
    assert len(r_res.history["loss"]) == 4
    for key in r_full.history.keys():
        if key not in ("epoch_time", "samples_per_second", "eta"):
            assert r_res.history[key] == r_full.history[key], key


@pytest.mark.parametrize(
    "make,exc,match",
    [
        (lambda p: p / "missing.pt", ValueError, "no such file"),
        (lambda p: (p / "bare.pt", torch.save({"w": torch.ones(1)}, p / "bare.pt"))[0], ValueError, "no full training state"),
        (lambda p: (p / "junk.pt", (p / "junk.pt").write_bytes(b"not a checkpoint"))[0], ValueError, "not a readable"),
    ],
    ids=["missing", "bare-state-dict", "junk"],
)
def test_bad_resume_files_raise_before_anything_changes(make, exc, match, tmp_path):
    net, before = _net(), _net()
    with pytest.raises(exc, match=match):
        train(net, _data(), _cfg("backprop", resume_from=make(tmp_path)))
    assert _same(net, before)


def test_resume_checks_method_model_and_epochs(tmp_path):
    from torchloom import Checkpoint

    path = tmp_path / "run.pt"
    train(_net(), _data(), _cfg("backprop", epochs=2, observers=[Checkpoint(path, save_best_only=False)]))
    with pytest.raises(ValueError, match="written by method .backprop., this run uses method .tween."):
        train(_net(), _data(), _cfg("tween", epochs=3, resume_from=path))
    with pytest.raises(ValueError, match="must be > 2"):
        train(_net(), _data(), _cfg("backprop", epochs=2, resume_from=path))
    with pytest.raises(ValueError, match="does not match this model"):
        train(_net(sizes=(6, 5, 4)), _data(), _cfg("backprop", epochs=3, resume_from=path))


# ------------------------------------------------------------- validation, metrics, data forms
@pytest.mark.parametrize("name", list(METHODS))
def test_validation_and_metrics_against_a_hand_computation(name):
    class Snap:  # the weights at each epoch's end, to recompute the validation numbers by hand
        def __init__(self):
            self.states = []

        def on_epoch_end(self, trainer, epoch, logs):
            self.states.append(copy.deepcopy(trainer.model.state_dict()))

    data, val = _data(), _data(n=3, seed=7)
    snap = Snap()
    net = _net()
    result = train(net, data, _cfg(name, validation_data=val, metrics=("accuracy",), observers=[snap]))
    ref = _net()
    for epoch, state in enumerate(snap.states):
        ref.load_state_dict(state)
        xs = torch.cat([x for x, _ in val])
        ys = torch.cat([y for _, y in val])
        with torch.no_grad():
            out = ref(xs)
        if name in GRADIENT_RULES:  # their loss_type: cross_entropy; TargetProp's and Tween's: "mse" to one-hot
            want_loss = F.cross_entropy(out, ys).item()
        else:
            want_loss = F.mse_loss(out, F.one_hot(ys, 4).double()).item()
        want_acc = (out.argmax(-1) == ys).double().mean().item()
        assert result.history["val_loss"][epoch] == pytest.approx(want_loss, rel=1e-12)
        assert result.history["val_accuracy"][epoch] == pytest.approx(want_acc, abs=1e-15)
    assert all(0.0 <= a <= 1.0 for a in result.history["accuracy"])


def test_training_accuracy_is_the_mean_over_the_epochs_pre_update_outputs():
    class Outputs:
        def __init__(self):
            self.correct, self.total = 0, 0

        def on_layer_forward(self, event):  # the last layer's output is the network output
            if event.layer_index == 1:
                self.out = event.output.detach().clone()

    data = _data()
    net_a, net_b = _net(), _net()
    ra = train(net_a, data, _cfg("backprop", epochs=1, metrics=("accuracy",)))
    # recompute by hand: the pre-update outputs of each step, with the same weights trajectory
    hits = 0
    for x, y in data:
        with torch.no_grad():
            hits += int((net_b(x).argmax(-1) == y).sum())
        train(net_b, [(x, y)], _cfg("backprop", epochs=1))
    assert ra.history["accuracy"][0] == pytest.approx(hits / 30, abs=1e-15)


@pytest.mark.parametrize("name", list(METHODS))
def test_xy_tensors_with_batch_size_and_seeded_shuffle(name):
    xs = torch.cat([x for x, _ in _data()])
    ys = torch.cat([y for _, y in _data()])
    a, b = _net(), _net()
    ra = train(a, (xs, ys), _cfg(name, batch_size=6))
    rb = train(b, _data(), _cfg(name))
    assert ra.loss_history == rb.loss_history and _same(a, b)  # unshuffled: the same batches in order
    c, d = _net(), _net()
    rc = train(c, (xs, ys), _cfg(name, batch_size=6, shuffle=True, seed=3))
    rd = train(d, (xs, ys), _cfg(name, batch_size=6, shuffle=True, seed=3))
    assert rc.loss_history == rd.loss_history and _same(c, d)
    assert not _same(c, a)


def test_shuffled_run_resumes_exactly(tmp_path):
    from torchloom import Checkpoint

    xs = torch.cat([x for x, _ in _data()])
    ys = torch.cat([y for _, y in _data()])
    kw = dict(batch_size=5, shuffle=True, seed=11, validation_data=_data(n=2, seed=4), metrics=("accuracy",))
    full = _net()
    r_full = train(full, (xs, ys), _cfg("tween", epochs=4, **kw))
    path = tmp_path / "tw.pt"
    train(_net(), (xs, ys), _cfg("tween", epochs=2, observers=[Checkpoint(path, save_best_only=False)], **kw))
    resumed = _net(seed=5)
    r_res = train(resumed, (xs, ys), _cfg("tween", epochs=4, resume_from=path, **kw))
    assert _same(resumed, full) and r_res.loss_history == r_full.loss_history
    assert r_res.history["val_loss"] == r_full.history["val_loss"]


def test_epoch_interval_schedules_and_reduce_on_plateau():
    import functools

    from torch.optim.lr_scheduler import ReduceLROnPlateau, StepLR

    data = _data()
    net = _net()
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    sched = StepLR(opt, step_size=1, gamma=0.5)
    train(net, data, _cfg("backprop", optimizer=opt, scheduler=sched, scheduler_interval="epoch"))
    assert opt.param_groups[0]["lr"] == pytest.approx(0.1 * 0.5**3)  # once per epoch, not per batch
    tw = TweenTrainer(_net(), TweenConfig(base_rate=0.05), training=_cfg("tween", scheduler=functools.partial(ReduceLROnPlateau, factor=0.5, patience=0, threshold=0.9)))
    tw.fit(data, 3)
    assert tw.rates.lr == pytest.approx(0.05 * 0.5**2)  # only the first epoch counts as an improvement (by 90 %)
    with pytest.raises(ValueError, match="learning_rate=0.5 is given with an optimizer instance"):
        TrainingConfig(optimizer=torch.optim.SGD(_net().parameters(), lr=0.1), learning_rate=0.5)


@pytest.mark.cuda
@pytest.mark.parametrize("name", list(METHODS))
@pytest.mark.parametrize("cuda_graph", [None, False])
def test_cuda_overflowing_updates_are_undone_on_the_device(name, cuda_graph):
    """The device path decides the weight check inside the (captured) step: no ±Inf/NaN weights."""
    data = [(x.float() * 1e3, y) for x, y in _data()]
    net = _net(torch.float32, acts=("linear", "linear"))
    before = copy.deepcopy(net)
    method = copy.deepcopy(METHODS[name])
    kw = dict(learning_rate=1e37) if name in GRADIENT_RULES else {}
    if isinstance(method, TweenConfig):
        method.base_rate = 1e37
    elif isinstance(method, TargetPropConfig):
        method.learning_rate = 1e37
    cfg = TrainingConfig(method=method, epochs=2, verbose=0, use_gpu=True, cuda_graph=cuda_graph,
                         loss_type="cross_entropy" if name in GRADIENT_RULES else "mse", **kw)
    with pytest.warns(DivergenceWarning):
        result = train(net, data, cfg)
    assert all(torch.isfinite(p).all() for p in net.parameters())
    assert result.skipped_batches == 10 and _same(net.cpu(), before)


# ------------------------------------------------------------------ the device runner, per fit
@pytest.mark.cuda
@pytest.mark.parametrize("name", list(METHODS))
@pytest.mark.parametrize("cuda_graph", [None, False])
def test_cuda_resume_is_exact(name, cuda_graph, tmp_path):
    """2 epochs + resume for 2 more = 4 epochs in one run, on the device path too: the restored method
    state (Tween's rule and velocities, TargetProp's budgets and velocities) reaches the device."""
    from torchloom import Checkpoint

    f32 = torch.float32  # (float64 optimizer updates run their host-reading reference: never captured)
    data = _data(dtype=f32)
    kw = dict(use_gpu=True, cuda_graph=cuda_graph)
    full = _net(f32)
    r_full = train(full, data, _cfg(name, epochs=4, **kw))
    path = tmp_path / "state.pt"
    train(_net(f32), data, _cfg(name, epochs=2, observers=[Checkpoint(path, save_best_only=False)], **kw))
    resumed = _net(f32, seed=5)
    r_res = train(resumed, data, _cfg(name, epochs=4, resume_from=path, **kw))
    assert r_res.loss_history == r_full.loss_history
    assert _same(resumed, full)


@pytest.mark.cuda
@pytest.mark.parametrize("name", list(METHODS))
def test_cuda_second_fit_trains_on_its_own_batches(name):
    """A trainer's second ``fit`` captures its own graphs: the first fit's graphs (captured over the
    first batches) never replay over the second fit's data."""
    from torchloom.engine.train import make_trainer

    f32 = torch.float32
    first, second = _data(seed=1, dtype=f32), _data(seed=2, dtype=f32)
    runs = {}
    for graph in (None, False):
        trainer = make_trainer(_net(f32), _cfg(name, use_gpu=True, cuda_graph=graph))
        trainer.fit(first, 1)
        result = trainer.fit(second, 1)
        runs[graph] = (result.loss_history, [p.detach().cpu() for p in trainer.model.parameters()])
    assert runs[None][0] == pytest.approx(runs[False][0], rel=1e-6, abs=0)
    for a, b in zip(runs[None][1], runs[False][1]):
        assert_close(a, b, name="weights after the second fit", rtol=1e-5, atol=1e-6)
