"""The feedback rules on the engine's device path: their fused backward (``kernels/feedback.py``,
through Triton's interpreter on CPU tensors; native on CUDA) trains as their host step (the plain
PyTorch backward), and alignment diagnostics on the device path (the runner's probe) log the host
path's numbers. CUDA-only tests (graph capture) skip without a GPU."""

from __future__ import annotations

import copy
import math

import numpy as np
import pytest
import torch

from torchloom import Dense, DFAConfig, Network, SignSymmetryConfig, TrainingConfig, train
from torchloom.engine.cuda_path import CudaRunner
from torchloom.engine.train import make_trainer
from torchloom.kernels._triton import interpreter_enabled, triton_available

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
RULES = {
    "dfa": DFAConfig(seed=5),
    "sign_symmetry": SignSymmetryConfig(),
    "sign_symmetry_unit": SignSymmetryConfig(scale="unit"),
    "sign_symmetry_number": SignSymmetryConfig(scale=0.3),
    "feedback_alignment": "feedback_alignment",
    "fast_proxy": "fast_proxy",
}


def _net(seed=0, device=DEVICE):
    torch.manual_seed(seed)
    return Network(Dense(6, 9, "tanh"), Dense(9, 4, "relu"), Dense(4, 3)).to(device)


def _data(n=3, bs=5, device=DEVICE):
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(bs, 6, generator=g).to(device), torch.randint(0, 3, (bs,), generator=g).to(device)) for _ in range(n)]


def _cfg(rule, **kw):
    return TrainingConfig(**{"method": copy.deepcopy(RULES[rule]), "loss_type": "cross_entropy", "epochs": 2, "verbose": 0,
                             "optimizer": "momentum", "learning_rate": 0.2, **kw})


@pytest.mark.skipif(not triton_available(), reason="the fused backward is a Triton kernel")
@pytest.mark.parametrize("rule", list(RULES))
def test_fused_device_step_equals_the_plain_backward(rule, monkeypatch):
    from torchloom.kernels import feedback

    launches = []
    real = feedback._launch
    monkeypatch.setattr(feedback, "_launch", lambda *a: launches.append(1) or real(*a))
    data = _data()
    ref = make_trainer(_net(), _cfg(rule, cuda_graph=False))  # (eager device steps: every launch counted)
    ref.kernel_backend = "reference"  # the rule's plain PyTorch backward (the layers' own), on any device
    if DEVICE == "cpu":
        ref._runner = CudaRunner(ref)
    rh = ref.fit(data, 2)
    host = ref.model
    assert not launches
    trainer = make_trainer(_net(), _cfg(rule, cuda_graph=False))
    trainer.kernel_backend = "triton" if DEVICE == "cpu" else None
    trainer._runner = CudaRunner(trainer)  # the device step, eager, on any device
    rd = trainer.fit(data, 2)
    # DFA: two launches a step (e [B_1|B_2], then the three layers' dW/db); sign symmetry: one for each
    # layer above the first; the others keep the layers' backward
    per_step = {"dfa": 2, "feedback_alignment": 0, "fast_proxy": 0}.get(rule, 2)
    assert len(launches) == per_step * 6
    np.testing.assert_allclose(rd.loss_history, rh.loss_history, rtol=1e-5)
    for p, q in zip(trainer.model.parameters(), host.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)


# ------------------------------------------------------------------ alignment on the device path
def _device_run(net, data, cfg):
    """``fit`` through the engine's device runner (eager device steps on the CPU; on CUDA ``train``'s
    own runner, graphs captured)."""
    trainer = make_trainer(net, cfg)
    if DEVICE == "cpu":
        trainer._runner = CudaRunner(trainer)
    return trainer.fit(data, cfg.epochs), trainer


@pytest.mark.parametrize("rule", ["dfa", "sign_symmetry", "tween", "backprop"])
def test_device_probe_logs_the_host_paths_angles(rule):
    """Steps 0, 4, 8, … of a 3-epoch run over 5 batches are measured (none falls in epoch 2 for
    N = 11); the angles, read once per epoch from the device accumulators, equal the host path's
    (on the CPU: to the last digits; a method measured by its applied change, Tween, to its
    device step's rounding), and the training is the same with and without the probe."""
    from torchloom import TweenConfig

    method = {"tween": TweenConfig(base_rate=0.1), "backprop": "backprop"}.get(rule) or copy.deepcopy(RULES[rule])
    rate = {} if rule == "tween" else {"learning_rate": 0.1}
    data = _data(n=5)
    for every in (4, 11):
        cfg = lambda **kw: TrainingConfig(method=copy.deepcopy(method), loss_type="cross_entropy", epochs=3, verbose=0,  # noqa: E731
                                          **rate, **kw)
        host = train(_net(device="cpu"), [(x.cpu(), y.cpu()) for x, y in data], cfg(alignment_every=every))
        plain, _ = _device_run(_net(), data, cfg())
        dev, trainer = _device_run(_net(), data, cfg(alignment_every=every))
        assert trainer._runner is not None and trainer.alignment.__dict__.get("dev_sums") is not None
        np.testing.assert_allclose(dev.loss_history, plain.loss_history, rtol=1e-6 if CUDA else 0)
        for i in range(3):
            key = f"alignment_bp/{i}"
            # (Tween's device step rounds differently from its host step: its applied change with it)
            tol = 1e-4 if CUDA else 1e-5 if rule == "tween" else 1e-9
            np.testing.assert_allclose(dev.history[key], host.history[key], rtol=tol, atol=tol)
        if every == 11:
            assert np.isnan(dev.history["alignment_bp/0"][1]) and not np.isnan(dev.history["alignment_bp/0"][2])


def test_device_probe_counts_only_steps_that_counted():
    """A step whose status is not OK (here: the NaN loss of a batch) measures nothing; the fold's
    arithmetic is exact (a sum of the counted angles over their number)."""
    from torchloom.engine.alignment import AlignmentProbe

    trainer = make_trainer(_net(device="cpu"), _cfg("dfa"))
    probe = AlignmentProbe(trainer, every=3)
    assert [probe.due(s) for s in range(7)] == [True, False, False, True, False, False, True]
    probe.device_buffers(torch.device("cpu"))
    x, y = _data(n=1, device="cpu")[0]
    angles = []
    for status in (0, 2, 0, 3):
        probe.measure(x, y)
        angles.append(probe._angles(probe._pending))
        probe.fold(torch.tensor(status, dtype=torch.int32))
    assert float(probe.dev_count) == 2.0
    want = ((angles[0] + angles[2]) / 2).tolist()
    assert list(probe.epoch_logs().values()) == pytest.approx(want, rel=1e-15)
    assert float(probe.dev_count) == 0.0 and all(np.isnan(list(probe.epoch_logs().values())))


@pytest.mark.skipif(not (triton_available() and interpreter_enabled()), reason="the fused backward through Triton's interpreter")
@pytest.mark.parametrize("rule", ["sign_symmetry", "dfa", "feedback_alignment", "fast_proxy"])
def test_fused_device_run_logs_the_host_paths_angles_at_batch_4(rule):
    """Issue 35: at batch 4 under softmax cross-entropy, sign symmetry's error below a layer whose
    every unit sends back through one-signed weights cancels exactly (``s · Σ_c ∂loss/∂z_c = 0``),
    leaving a direction of float32 rounding (~1e-8) whose angle depended on the kernel's sum order
    (host 60.8° vs fused 62.0°, or NaN vs a number). Such steps measure nothing for those layers;
    the epoch's angles of the fused device run (Triton's interpreter) then equal the host path's,
    and the other steps still give each epoch a value."""
    g = torch.Generator().manual_seed(2)
    xs, ys = torch.randn(83, 6, generator=g), torch.randint(0, 3, (83,), generator=g)
    data = [(xs[i : i + 4], ys[i : i + 4]) for i in range(0, 83, 4)]
    cfg = lambda: TrainingConfig(method=copy.deepcopy(RULES[rule]), loss_type="cross_entropy", epochs=1, verbose=0,  # noqa: E731
                                 learning_rate=0.1, alignment_every=5)
    host = train(_net(device="cpu"), data, cfg())
    trainer = make_trainer(_net(device="cpu"), cfg())
    trainer.kernel_backend = "triton"
    trainer._runner = CudaRunner(trainer)
    dev = trainer.fit(data, 1)
    for i in range(3):
        key = f"alignment_bp/{i}"
        assert np.isfinite(host.history[key]).all(), (key, host.history[key])
        np.testing.assert_allclose(dev.history[key], host.history[key], rtol=1e-4, atol=1e-3)


def test_a_direction_of_rounding_noise_measures_nothing_and_a_small_real_one_does():
    """The probe's rounding-noise test (``_rounding_noise``) on gains ``‖d‖ / ‖∇‖`` per layer: a
    deep feedback-alignment-like chain whose gain drops 10× per layer is kept; a gain 1e-7 of the
    layer above's (and any layer below it whose gain is of the same order) is noise; a zero ∇
    (infinite or NaN gain) does not reset the reference."""
    from torchloom.engine.alignment import _rounding_noise

    gains = torch.tensor([1e-6, 1e-5, 1e-4, 1e-3, 1e-2, 1e-1, 1.0], dtype=torch.float64)
    assert not _rounding_noise(gains).any()
    gains = torch.tensor([3e-8, 2e-8, 0.3, 1e-7, 0.4, 1.0], dtype=torch.float64)
    assert _rounding_noise(gains).tolist() == [True, True, False, True, False, False]
    gains = torch.tensor([1e-9, math.inf, math.nan, 0.5, 1.0], dtype=torch.float64)
    assert _rounding_noise(gains).tolist() == [True, False, False, False, False]


@pytest.mark.skipif(not CUDA, reason="graph capture needs CUDA")
@pytest.mark.parametrize("rule", ["dfa", "sign_symmetry", "backprop"])
def test_captured_run_with_alignment_equals_host_angles_and_stays_captured(rule):
    """On CUDA: ``cuda_graph=True`` with ``alignment_every`` (refused before) captures the chunk,
    tail and the two one-step graphs, a ragged last batch included, and the angles match the host
    path's (same float32 model on the CPU), steps measured in chunks and in the tail."""
    method = "backprop" if rule == "backprop" else copy.deepcopy(RULES[rule])
    g = torch.Generator().manual_seed(2)
    xs, ys = torch.randn(83, 6, generator=g), torch.randint(0, 3, (83,), generator=g)
    cfg = lambda **kw: TrainingConfig(method=copy.deepcopy(method), loss_type="cross_entropy", epochs=3, verbose=0,  # noqa: E731
                                      learning_rate=0.1, batch_size=4, **kw)
    host = train(_net(device="cpu"), (xs, ys), cfg(alignment_every=5))  # (step 20: epoch 1's ragged last batch)
    net = _net(device="cuda")
    dev = train(net, (xs.cuda(), ys.cuda()), cfg(alignment_every=5, cuda_graph=True))
    plain = train(_net(device="cuda"), (xs.cuda(), ys.cuda()), cfg(cuda_graph=True))
    np.testing.assert_allclose(dev.loss_history, plain.loss_history, rtol=1e-6)
    np.testing.assert_allclose(dev.loss_history, host.loss_history, rtol=1e-4)
    for i in range(3):
        key = f"alignment_bp/{i}"
        np.testing.assert_allclose(dev.history[key], host.history[key], rtol=1e-3, atol=1e-2)


class _Graph:
    """A stand-in for a captured graph (CPU): ``replay`` notes its name and the batch in its slot
    (every batch of the test is filled with its index)."""

    def __init__(self, log, name, slot=None):
        self.log, self.name, self.slot = log, name, slot

    def replay(self):
        slot = self.slot()
        self.log.append((self.name, [int(v) for v in slot.reshape(slot.shape[0], -1)[:, 0]] if slot.dim() == 3 else int(slot[0, 0])))


def test_replay_runs_the_chunks_that_hold_a_measured_step_through_the_one_step_graphs():
    """The runner's choice of graphs with alignment diagnostics (CPU, stand-in graphs): 10 batches of
    5 and a ragged one of 3, chunks of 4 (steps 0-3, 4-7), a tail 8-10, every 7th global step
    measured: a chunk or tail holding a measured step runs step by step through the one-step graphs
    ("probe" at the measured step, "plain" elsewhere; the ragged batch eagerly), the others replay
    their graph once."""
    from types import SimpleNamespace

    from torchloom.engine.alignment import AlignmentProbe

    trainer = make_trainer(_net(device="cpu"), _cfg("dfa"))
    runner = CudaRunner(trainer)
    trainer.alignment = AlignmentProbe(trainer, 7)
    items = [(torch.full((5, 6), float(k)), torch.zeros(5, dtype=torch.long)) for k in range(10)]
    items.append((torch.full((3, 6), 10.0), torch.zeros(3, dtype=torch.long)))
    runner._prepare_arrays(len(items))
    log = []
    rows = lambda k: dict(loss=torch.zeros(k, 4), status=torch.zeros(k, 4, dtype=torch.int32), logs=torch.zeros(k, 1))  # noqa: E731
    chunk = dict(x=torch.zeros(4, 5, 6), y=torch.zeros(4, 5, dtype=torch.long), n_chunks=2, **rows(4))
    chunk["graph"] = _Graph(log, "chunk", lambda: chunk["x"])
    one = dict(x=torch.zeros(5, 6), y=torch.zeros(5, dtype=torch.long), lr=torch.zeros(1, 1, 4), **rows(1))
    one["plain"], one["probe"] = _Graph(log, "plain", lambda: one["x"]), _Graph(log, "probe", lambda: one["x"])
    runner._chunk, runner._single, runner._tail_start = chunk, one, 8
    runner.graphs = [_Graph(log, "tail", lambda: torch.zeros(1, 1))]
    runner.measured_step = lambda x, y, k, measured: log.append(("eager", k, measured, int(x[0, 0])))
    source = SimpleNamespace(items=items)
    runner._replay(source, 0)  # global steps 0-10: 0 and 7 measured
    assert log == [("probe", 0), ("plain", 1), ("plain", 2), ("plain", 3), ("plain", 4), ("plain", 5), ("plain", 6),
                   ("probe", 7), ("tail", 0)]
    log.clear()
    runner._replay(source, 11)  # global steps 11-21: 14 (step 3) and 21 (step 10, the ragged batch)
    assert log == [("plain", 0), ("plain", 1), ("plain", 2), ("probe", 3), ("chunk", [4, 5, 6, 7]), ("plain", 8), ("plain", 9),
                   ("eager", 10, True, 10)]
    log.clear()
    runner._replay(source, 22)  # 28 (step 6)
    assert log == [("chunk", [0, 1, 2, 3]), ("plain", 4), ("plain", 5), ("probe", 6), ("plain", 7), ("tail", 0)]


def test_a_top_layer_without_a_finite_gain_is_no_reference_for_the_noise_rule():
    """A user rule whose top layer has an exact gradient of 0 (gain Inf) or none: the layers below are
    judged against the nearest real gain, not flagged as noise against Inf."""
    from torchloom.engine.alignment import _rounding_noise

    for top in (math.inf, math.nan, 0.0):
        gains = torch.tensor([1e-9, 0.5, 0.3, top], dtype=torch.float64)
        assert _rounding_noise(gains).tolist() == [True, False, False, False]
