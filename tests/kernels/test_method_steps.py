"""The fused pieces of TargetProp's and Tweening's device steps (``kernels/method_steps.py``), each
against its torch-ops reference, and the fused steps themselves against the torch-op device steps
(the engine's runner on CPU tensors; the kernels through Triton's interpreter in CI, on CUDA on a
GPU machine)."""

import copy
import math

import numpy as np
import pytest
import torch

from torchloom import Dense, Network, TargetPropConfig, TrainingConfig, TweenConfig
from torchloom.kernels._triton import triton_available
from torchloom.engine.cuda_path import CudaRunner
from torchloom.engine.train import make_trainer

pytestmark = pytest.mark.skipif(not triton_available(), reason="the fused steps are Triton kernels")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _ms():
    from torchloom.kernels import method_steps

    return method_steps


# --------------------------------------------------------------------------------- kernels
@pytest.mark.parametrize("mode", ["TP", "TP_CE", "TWEEN_MSE", "TWEEN_CE"])
@pytest.mark.parametrize("labels", [True, False])
@pytest.mark.parametrize("shape", [(1, 3), (7, 10), (5, 33)])
def test_target_rows_match_reference(mode, labels, shape):
    ms = _ms()
    g = torch.Generator().manual_seed(3)
    out = torch.randn(*shape, generator=g).to(DEVICE)
    y = torch.randint(0, shape[1], (shape[0],), generator=g) if labels else torch.rand(*shape, generator=g)
    y = y.to(DEVICE)
    got = ms.target_rows(out, y, getattr(ms, mode), gap_threshold=0.3)
    want = ms.target_rows_ref(out, y, getattr(ms, mode), gap_threshold=0.3)
    for name, a, b in zip(("loss", "g", "t", "y_hat", "correct"), got, want):
        if name == "correct" and not labels:
            continue
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=name)


def test_target_rows_gap_threshold_masks_rows_below_it():
    ms = _ms()
    out = torch.tensor([[0.0, 1.0], [1.0, 0.0]], device=DEVICE)
    y = torch.tensor([1, 1], device=DEVICE)  # row 0 right (error 0), row 1 wrong (error 2)
    _, g, *_ = ms.target_rows(out, y, ms.TWEEN_MSE, gap_threshold=1.0)
    assert torch.all(g[0] == 0) and torch.all(g[1] != 0)


@pytest.mark.parametrize("scale", [None, 0.7, -1.3, "t=f"])
@pytest.mark.parametrize("extra", [False, True])
@pytest.mark.parametrize("n", [1, 37, 5000] + ([1_500_000] if DEVICE == "cuda" else []))  # > 1024 blocks: grid-stride
def test_layer_stats_partials_sum_to_the_reference(scale, extra, n):
    ms = _ms()
    g = torch.Generator().manual_seed(n)
    f, t = torch.randn(n, generator=g).to(DEVICE), torch.randn(n, generator=g).to(DEVICE)
    if scale == "t=f":
        t, scale = None, None
    e = torch.randn(max(n // 2, 1), generator=g).to(DEVICE) if extra else None
    p = ms.stats_programs(n, f.is_cuda)
    part = torch.zeros(p + 2, 5, device=DEVICE)  # spare rows stay zero
    ms.layer_stats_into(part, f, t, e, scale)
    want = ms.stats_ref(f, t, e, scale)
    torch.testing.assert_close(part.double().sum(0), want.double(), rtol=1e-5, atol=1e-5 * max(1, n // 1000))
    assert torch.all(part[p:] == 0)


def _partials(layers, p, seed):
    g = torch.Generator().manual_seed(seed)
    part = torch.rand(layers, p, 5, generator=g)
    part[..., 0] -= 0.4  # dot products of either sign
    return part.to(DEVICE)


@pytest.mark.parametrize("status", [0, 1, 2])
@pytest.mark.parametrize("clip", [False, True])
@pytest.mark.parametrize("labels", [False, True])
def test_tp_rule_matches_reference(status, clip, labels):
    ms = _ms()
    f64 = dict(dtype=torch.float64, device=DEVICE)
    n, rows = 3, 6
    part = _partials(n, 4, status)
    part[1, :, 2] = 0.0  # a layer with a zero target: its budget stays
    widths = torch.tensor([12.0, 9.0, 4.0], **f64)
    consts = torch.tensor([0.45, 0.8], **f64)
    depth = torch.tensor([1.0, 1.2, 1.44], **f64)
    weighted = torch.ones(n, dtype=torch.int8, device=DEVICE)
    seg = torch.tensor([0, 0, 1, 1, 2], dtype=torch.int32, device=DEVICE)
    trainable = torch.tensor([1, 1, 0, 1, 1], dtype=torch.int8, device=DEVICE)
    lr = torch.tensor([0.05], **f64)
    scale = torch.tensor(0.3, device=DEVICE) if clip else None
    correct = torch.tensor([1.0, 0.0, 1.0, 1.0, 0.0, 0.0], device=DEVICE) if labels else None
    found_inf = torch.tensor(0.0 if status == 0 else 1.0, device=DEVICE)
    st = torch.tensor(status, dtype=torch.int32, device=DEVICE)
    b_ref = torch.tensor([0.2, 0.7, 0.5], **f64)
    b_ker = b_ref.clone()
    want = ms.tp_rule_ref(part, widths, consts, b_ref, depth, weighted, st, found_inf, lr, scale, correct, rows, seg.long(), trainable)
    log = torch.empty(4, **f64)
    got = ms.tp_rule_(part, widths, consts, b_ker, depth, weighted, st, found_inf, lr, scale, correct, rows, seg, trainable, log)
    torch.testing.assert_close(b_ker, b_ref, rtol=1e-12, atol=1e-12)
    for name, a, b in zip(("a", "c", "apply"), got, want[:3]):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-15, msg=name)
    torch.testing.assert_close(log, want[3], rtol=1e-12, atol=1e-15, equal_nan=True)
    assert torch.equal(b_ref[1], torch.tensor(0.7, **f64))  # zero target: no measurement


@pytest.mark.parametrize("found_inf", [0.0, 1.0])
@pytest.mark.parametrize("clip", [False, True])
def test_tween_rule_matches_its_references(found_inf, clip):
    from torchloom.kernels.explosion_rule import STATE_FIELDS, explosion_rule_ref_, rule_constants
    from torchloom.methods.tween import EXPLOSION_RULE, _TensorOps

    ms = _ms()
    f64 = dict(dtype=torch.float64, device=DEVICE)
    cfg = TweenConfig(base_rate=0.05, link_budget_scale=0.6, momentum_decay=0.8)
    n, rows = 3, 5
    part = _partials(n + 1, 3, 7)
    widths = torch.tensor([6.0, 12.0, 9.0, 4.0], **f64)
    consts = torch.tensor([cfg.link_budget_scale, cfg.momentum_decay], **f64)
    scales = torch.tensor([1.0, 0.8, 0.6], **f64)
    seg = torch.tensor([0, 0, 1, 1, 2, 2], dtype=torch.int32, device=DEVICE)
    trainable = torch.tensor([1, 1, 1, 0, 1, 1], dtype=torch.int8, device=DEVICE)
    lr = torch.tensor([0.05], **f64)
    grad_scale = torch.tensor(0.5, device=DEVICE) if clip else None
    fi = torch.tensor(found_inf, device=DEVICE)
    # a state past the warm-up whose baseline sits far below this step's gap: an explosion
    values = dict(adaptive_rate=0.04, explosion_count=1.0, steps=20.0, prev_avg_gap=1e-3, gap_baseline=1e-3,
                  gap_growth_rate=1.0, gap_log_mean=math.log(1e-4), gap_log_dev=0.1, gap_log_peak=math.log(1e-4), explosion_pressure=0.0)
    state_ref = torch.tensor([values[k] for k in STATE_FIELDS], **f64)
    state_ker = state_ref.clone()
    constants = rule_constants(EXPLOSION_RULE, cfg, DEVICE)
    log = torch.empty(6, **f64)
    a, c, apply, metrics = ms.tween_rule_(part, widths, consts, scales, state_ker, constants, lr, grad_scale, fi, rows, seg, trainable, log)
    want = ms.tween_metrics_ref(part, widths, rows)
    torch.testing.assert_close(metrics, want, rtol=1e-12, atol=1e-15)
    avg_gap = want[:, 0].mean()
    exploded = explosion_rule_ref_(EXPLOSION_RULE, _TensorOps, cfg, state_ref, avg_gap, lr.reshape(()), fi)
    torch.testing.assert_close(state_ker, state_ref, rtol=1e-12, atol=0, equal_nan=True)
    assert bool(exploded) == (found_inf == 0)  # the spike explodes on an applied step only
    s = cfg.link_budget_scale
    rates = state_ref[0] * (1 - s / 2 + s / 2 * want[:, 2]) * scales
    if clip:
        rates = rates * 0.5
    torch.testing.assert_close(c, (-rates / rows)[seg.long()], rtol=1e-12, atol=1e-15)
    torch.testing.assert_close(a, torch.full_like(a, 0.0 if bool(exploded) else cfg.momentum_decay))
    assert torch.equal(apply, (trainable * (1 if found_inf == 0 else 0)).to(torch.int8))
    want_log = torch.stack([avg_gap, want[:, 1].mean(), exploded.double(), state_ref[0], state_ref[4], state_ref[1]])
    torch.testing.assert_close(log, want_log, rtol=1e-12, atol=1e-15)


# ----------------------------------------------------------------------------- whole steps
def _net(dtype=torch.float32, sizes=(6, 12, 9, 4), acts=("tanh", "relu", "sigmoid")):
    torch.manual_seed(0)
    return Network(*[Dense(a, b, f, dtype=dtype) for a, b, f in zip(sizes[:-1], sizes[1:], acts)]).to(DEVICE)


def _data(n=6, bs=6, labels=True):
    g = torch.Generator().manual_seed(1)
    out = []
    for _ in range(n):
        x = torch.randn(bs, 6, generator=g)
        y = torch.randint(0, 4, (bs,), generator=g) if labels else torch.rand(bs, 4, generator=g)
        out.append((x.to(DEVICE), y.to(DEVICE)))
    return out


def _run(net, data, cfg, backend):
    trainer = make_trainer(net, cfg)
    trainer.kernel_backend = backend
    trainer._runner = CudaRunner(trainer)  # the device runner, eager (no graph), on any device
    return trainer.fit(data, cfg.epochs), trainer


def _same_run(method, data, loss_type="mse", rtol=1e-5, **extra):
    cfg = lambda: TrainingConfig(method=copy.deepcopy(method), epochs=2, verbose=0, loss_type=loss_type, **extra)  # noqa: E731
    ra, ta = _run(_net(), data, cfg(), "reference")
    rb, tb = _run(_net(), data, cfg(), "triton" if DEVICE == "cpu" else None)
    assert ta._fused is None and tb._fused is not None
    np.testing.assert_allclose(rb.loss_history, ra.loss_history, rtol=rtol)
    for p, q in zip(tb.model.parameters(), ta.model.parameters()):
        torch.testing.assert_close(p, q, rtol=rtol, atol=1e-6)
    for key in ra.history.keys():
        if key not in ("epoch_time", "samples_per_second", "eta"):
            np.testing.assert_allclose(rb.history[key], ra.history[key], rtol=rtol, atol=1e-7, err_msg=key)
    return ta, tb


EXTRAS = [dict(), dict(gradient_clip=0.05), dict(gradient_clip=0.01, clip_mode="value"), dict(scheduler=lambda s: 0.05 / (1 + s))]
EXTRA_IDS = ["plain", "norm-clip", "value-clip", "schedule"]


def _pairs(variants, ids):
    """Each setting of EXTRAS once and each variant (labels or a target, a loss) with the plain step and
    at least one setting, not every pair: a variant changes the target rows and the correct count, a
    setting the clip or the rate, different code of the step (the kernels that take both, the rules,
    are checked for every pair in test_tp_rule_matches_reference and test_tween_rule_matches_its_references),
    and each run of the interpreted step takes about a second."""
    plain = [pytest.param(dict(), v, id=f"plain-{i}") for v, i in zip(variants, ids)]
    return plain + [pytest.param(e, variants[k % len(variants)], id=f"{eid}-{ids[k % len(ids)]}")
                    for k, (e, eid) in enumerate(zip(EXTRAS[1:], EXTRA_IDS[1:]))]


@pytest.mark.parametrize("extra,labels", _pairs([True, False], ["labels", "targets"]))
def test_fused_target_prop_step_equals_the_torch_op_step(extra, labels):
    _same_run(TargetPropConfig(learning_rate=0.05, gate_threshold=0.3), _data(labels=labels), **extra)


@pytest.mark.parametrize("extra,labels", _pairs([True, False], ["labels", "targets"]))
def test_fused_pure_target_prop_step_equals_the_torch_op_step(extra, labels):
    _same_run(TargetPropConfig(mode="pure", learning_rate=0.02, gate_threshold=0.3), _data(labels=labels), **extra)


def test_fused_pure_target_prop_without_biases_and_with_a_dead_input_unit():
    torch.manual_seed(0)
    data = _data()
    for x, _ in data:
        x[:, 2] = 0.0

    def net():
        torch.manual_seed(0)
        n = Network(Dense(6, 12, "tanh", bias=False), Dense(12, 9, "relu"), Dense(9, 4, "sigmoid", bias=False)).to(DEVICE)
        with torch.no_grad():
            n.layers[1].weight[:, 3] = 0.0  # no connection: that unit's estimate is 0 (below MIN_CONNECTION)
        return n

    cfg = lambda: TrainingConfig(method=TargetPropConfig(mode="pure", learning_rate=0.02), epochs=2, verbose=0)  # noqa: E731
    ra, ta = _run(net(), data, cfg(), "reference")
    rb, tb = _run(net(), data, cfg(), "triton" if DEVICE == "cpu" else None)
    assert ta._fused is None and tb._fused is not None
    np.testing.assert_allclose(rb.loss_history, ra.loss_history, rtol=1e-5)
    for p, q in zip(tb.model.parameters(), ta.model.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("shape", [(1, 1, 5), (3, 7, 17), (16, 33, 70), (17, 33, 5), (300, 65, 40)])  # ≤ 16 rows: product in-kernel
def test_estimate_gap_matches_the_trainers_weighted_estimate(shape):
    from torchloom.methods import target_prop_pure as tp

    ms = _ms()
    assert ms.MIN_CONNECTION == tp._MIN_CONNECTION
    g = torch.Generator().manual_seed(shape[1])
    rows, cols, outs = shape
    w = torch.randn(outs, cols, generator=g)
    w[:, 0] = 0.001 / outs  # Σ|w| = 0.001 < MIN_CONNECTION: that input unit gets no estimate
    t_out = torch.randn(rows, outs, generator=g)
    act = torch.randn(rows, cols, generator=g)
    want = tp._weighted_estimate(t_out.double(), w.double(), w.double().abs().sum(0))
    t, gap = ms.estimate_gap(t_out.to(DEVICE), w.to(DEVICE), act.to(DEVICE))
    torch.testing.assert_close(t.cpu().double(), want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(gap.cpu().double(), want - act.double(), rtol=1e-5, atol=1e-5)
    assert torch.all(t[:, 0] == 0)
    ref_t, ref_gap = ms.estimate_gap_ref(t_out, w, act)
    torch.testing.assert_close(t.cpu(), ref_t, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(gap.cpu(), ref_gap, rtol=1e-5, atol=1e-5)


def test_target_rows_tp_cross_entropy_is_the_softmax_gap():
    """``TP_CE`` against torch's own cross-entropy and its autograd gradient (float64): the gap
    ``g = p − softmax(out)`` is minus the per-sample gradient, the target ``out + g``."""
    ms = _ms()
    g = torch.Generator().manual_seed(5)
    out = torch.randn(6, 7, generator=g, dtype=torch.float64, requires_grad=True)
    y = torch.randint(0, 7, (6,), generator=g)
    ce = torch.nn.functional.cross_entropy(out, y, reduction="sum")
    (grad,) = torch.autograd.grad(ce, out)
    loss, gap, target, _, correct = ms.target_rows(out.detach().float().to(DEVICE), y.to(DEVICE), ms.TP_CE)
    torch.testing.assert_close(loss.sum().cpu().double(), ce.detach() / 6, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(gap.cpu().double(), -grad, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(target.cpu().double(), out.detach() - grad, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(correct.cpu(), (out.argmax(-1) == y).float())


@pytest.mark.parametrize("shape", [(3, 7, 17), (300, 65, 40)])
def test_estimate_gap_difference_estimates_the_gap(shape):
    from torchloom.methods import target_prop_pure as tp

    ms = _ms()
    g = torch.Generator().manual_seed(shape[0])
    rows, cols, outs = shape
    w, gap_out, act = torch.randn(outs, cols, generator=g), torch.randn(rows, outs, generator=g), torch.randn(rows, cols, generator=g)
    e = tp._weighted_estimate(gap_out.double(), w.double(), w.double().abs().sum(0))
    t, gap = ms.estimate_gap(gap_out.to(DEVICE), w.to(DEVICE), act.to(DEVICE), difference=True)
    torch.testing.assert_close(gap.cpu().double(), e, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(t.cpu().double(), act.double() + e, rtol=1e-5, atol=1e-5)
    for a, b in zip((t, gap), ms.estimate_gap_ref(gap_out, w, act, difference=True)):
        torch.testing.assert_close(a.cpu(), b, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("mode,pure_targets", [("chain_rule", "difference"), ("pure", "difference"), ("pure", "loom")])
def test_fused_target_prop_cross_entropy_step_equals_the_torch_op_step(mode, pure_targets):
    _same_run(TargetPropConfig(mode=mode, pure_targets=pure_targets, learning_rate=0.05, gate_threshold=0.3), _data(labels=True), loss_type="cross_entropy")


def test_fused_loom_pure_target_prop_step_equals_the_torch_op_step():
    _same_run(TargetPropConfig(mode="pure", pure_targets="loom", learning_rate=0.02, gate_threshold=0.3), _data(labels=True))


@pytest.mark.parametrize("extra,loss", _pairs([("mse", True), ("mse", False), ("cross_entropy", True)], ["mse-labels", "mse-targets", "ce"]))
def test_fused_tween_step_equals_the_torch_op_step(extra, loss):
    loss_type, labels = loss
    _same_run(TweenConfig(base_rate=0.05), _data(labels=labels), loss_type=loss_type, **extra)


@pytest.mark.parametrize("method", [TweenConfig(base_rate=0.1, momentum_decay=0.5, depth_scaling=False), TweenConfig(gap_threshold=0.0, link_budget_scale=0.0)])
def test_fused_tween_step_other_settings(method):
    _same_run(method, _data(labels=False))


def test_fused_tween_step_explodes_and_recovers_like_the_torch_op_step():
    data = _data(n=14, labels=False)
    data[12] = (data[12][0] * 30, data[12][1] + 5)  # a spike after the rule's warm-up
    ta, tb = _same_run(TweenConfig(base_rate=0.05), data)
    assert ta.state.explosion_count == tb.state.explosion_count >= 1
    assert ta.state.rate_history == pytest.approx(tb.state.rate_history, rel=1e-9)


def test_fused_step_skips_nan_batches_like_the_torch_op_step():
    data = _data(n=5)
    data[2] = (data[2][0].clone(), data[2][1])
    data[2][0][1, 2] = float("inf")
    for method in (TargetPropConfig(learning_rate=0.05), TweenConfig(base_rate=0.05)):
        _same_run(method, data)


def test_fused_step_is_not_taken_where_it_does_not_apply():
    from torchloom import LayerNorm

    backend = "triton" if DEVICE == "cpu" else None
    cases = [
        (_net(torch.float64), TargetPropConfig()),  # float64: the exact torch-op step
        (Network(Dense(6, 8, "tanh"), LayerNorm(8), Dense(8, 4, "linear")).to(DEVICE), TweenConfig()),  # not all Dense
    ]
    for net, method in cases:
        trainer = make_trainer(net, TrainingConfig(method=method, verbose=0, loss_type="mse"))
        trainer.kernel_backend = backend
        CudaRunner(trainer)
        assert trainer._fused is None


@pytest.mark.parametrize("count", [1, 4, 8, 9])
def test_stats_into_one_launch_matches_each_pair(count):
    ms = _ms()
    g = torch.Generator().manual_seed(count)
    pairs = []
    for j in range(count):
        n = [1, 37, 300, 2049][j % 4]
        f, t = torch.randn(n, generator=g).to(DEVICE), torch.randn(n, generator=g).to(DEVICE)
        e = torch.randn(n, generator=g).to(DEVICE) if j % 2 else None
        kind = j % 3
        pairs.append((f, None, e, None) if kind == 0 else (f, t, e, 0.5 * j - 1) if kind == 1 else (f, t, e, None))
    part = ms.stats_into(pairs)
    for j, (f, t, e, scale) in enumerate(pairs):
        torch.testing.assert_close(part[j].double().sum(0), ms.stats_ref(f, t, e, scale).double(), rtol=1e-5, atol=1e-4, msg=f"pair {j}")


def test_fused_update_does_the_weight_guards_copy_and_check_itself():
    """Parameters and velocities are the guarded buffers: the fused update's launch saves and checks
    them (backup_views); with a frozen parameter the guard covers less, so the usual guard runs."""
    backend = "triton" if DEVICE == "cpu" else None
    for method in (TargetPropConfig(learning_rate=0.05), TweenConfig(base_rate=0.05)):
        trainer = make_trainer(_net(), TrainingConfig(method=copy.deepcopy(method), verbose=0, loss_type="mse"))
        trainer.kernel_backend = backend
        runner = CudaRunner(trainer)
        views = runner.update_guard.backup_views(trainer._flat.p, trainer._flat.v)
        assert views is not None and sum(v.numel() for v in views) == sum(t.numel() for t in runner.update_guard._live)
        net = _net()
        net.layers[1].bias.requires_grad_(False)
        trainer = make_trainer(net, TrainingConfig(method=copy.deepcopy(method), verbose=0, loss_type="mse"))
        trainer.kernel_backend = backend
        runner = CudaRunner(trainer)
        assert trainer._fused is not None
        assert runner.update_guard.backup_views(trainer._flat.p, trainer._flat.v) is None


def test_fused_step_with_a_frozen_parameter_equals_the_torch_op_step():
    data = _data()
    for method in (TargetPropConfig(learning_rate=0.05), TweenConfig(base_rate=0.05)):
        runs = []
        for backend in ("reference", "triton" if DEVICE == "cpu" else None):
            net = _net()
            net.layers[1].bias.requires_grad_(False)
            cfg = TrainingConfig(method=copy.deepcopy(method), epochs=2, verbose=0, loss_type="mse")
            runs.append(_run(net, data, cfg, backend))
        (ra, ta), (rb, tb) = runs
        np.testing.assert_allclose(rb.loss_history, ra.loss_history, rtol=1e-5)
        for p, q in zip(tb.model.parameters(), ta.model.parameters()):
            torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("pure_targets", ["difference", "loom"])
def test_fused_pure_target_prop_step_runs_under_bf16_autocast(pure_targets):
    """Under ``precision="bf16-mixed"`` the activations are bfloat16 and the weights float32: both steps
    form the targets, gaps and directions from them in float32 with autocast off (a Triton dot of bf16
    and fp32 operands does not compile; a bf16 estimate loses the gap), so they agree to float32
    rounding: the forward's bf16 products are the same on both."""
    cfg = lambda: TrainingConfig(  # noqa: E731
        method=TargetPropConfig(mode="pure", pure_targets=pure_targets, learning_rate=0.02, gate_threshold=0.3),
        epochs=2, verbose=0, loss_type="cross_entropy", precision="bf16-mixed",
    )
    data = _data(labels=True)
    ra, ta = _run(_net(), data, cfg(), "reference")
    rb, tb = _run(_net(), data, cfg(), "triton" if DEVICE == "cpu" else None)
    assert ta._fused is None and tb._fused is not None
    np.testing.assert_allclose(rb.loss_history, ra.loss_history, rtol=1e-4)
    for p, q in zip(tb.model.parameters(), ta.model.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-4, atol=1e-5)


def test_stats_into_writes_into_out_and_checks_it():
    """``stats_into(pairs, out=...)`` (the data-parallel steps' tail of the direction buffer) writes the
    same partials into a given view; a view of the wrong shape or dtype is refused by name."""
    ms = _ms()
    g = torch.Generator().manual_seed(3)
    pairs = [(torch.randn(300, generator=g).to(DEVICE), torch.randn(300, generator=g).to(DEVICE), None, None),
             (torch.randn(37, generator=g).to(DEVICE), None, None, None)]
    want = ms.stats_into(pairs)
    p = ms.stats_partials(pairs)
    assert want.shape == (2, p, 5)
    buffer = torch.full((7 + 2 * p * 5,), float("nan"), device=DEVICE)
    got = ms.stats_into(pairs, out=buffer[7:].view(2, p, 5))
    assert got.data_ptr() == buffer[7:].data_ptr()
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    assert torch.isnan(buffer[:7]).all()  # nothing written outside the view
    with pytest.raises(ValueError) as info:
        ms.stats_into(pairs, out=torch.zeros(2, p + 1, 5, device=DEVICE))
    assert str(info.value) == f"stats_into: out must be a contiguous float32 tensor of shape [2, {p}, 5], got torch.float32 [2, {p + 1}, 5]"
    with pytest.raises(ValueError, match=r"got torch.float64 \[2, "):
        ms.stats_into(pairs, out=torch.zeros(2, p, 5, dtype=torch.float64, device=DEVICE))


@pytest.mark.parametrize(
    "auto, explicit",
    [
        (TargetPropConfig(gate_threshold=0.3), TargetPropConfig(gate_threshold=0.3, learning_rate=0.1 * 6 / 16)),
        (TargetPropConfig(mode="pure", gate_threshold=0.3), TargetPropConfig(mode="pure", gate_threshold=0.3, learning_rate=0.05 * 6 / 16)),
        (TweenConfig(), TweenConfig(base_rate=0.03 * 6 / 16)),
    ],
    ids=["tp-chain", "tp-pure", "tween"],
)
@pytest.mark.parametrize("backend", ["reference", "fused"])
def test_device_steps_take_an_automatic_rate_as_its_explicit_rate(auto, explicit, backend):
    """The default rate (None) at batches of 6 rows is 6/16 of the mode's rate, on the torch-op device
    step and the fused one, as the same run at that rate given explicitly."""
    kernels = "reference" if backend == "reference" else ("triton" if DEVICE == "cpu" else None)
    data = _data()
    cfg = lambda m: TrainingConfig(method=copy.deepcopy(m), epochs=2, verbose=0, loss_type="mse")  # noqa: E731
    ra, ta = _run(_net(), data, cfg(auto), kernels)
    rb, tb = _run(_net(), data, cfg(explicit), kernels)
    assert (ta._fused is None) == (backend == "reference") and ta.rates.lr == (0.03 if isinstance(auto, TweenConfig) else auto.base_rate)
    np.testing.assert_allclose(ra.loss_history, rb.loss_history, rtol=1e-6)
    for p, q in zip(ta.model.parameters(), tb.model.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-7)
