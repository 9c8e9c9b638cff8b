"""LiveTrainer: serve/learn with late labels, every registered method through the live loop (the
same updates as train()), the schedules, overlap mode, the device-resident stream (eager on CPU),
the report's shock statistics, observers and CSV, bad input."""

from __future__ import annotations

import csv

import pytest
import torch

import torchloom.methods  # noqa: F401  (registers every method)
from torchloom import Dense, Network, TrainingConfig, method_names, train
from torchloom.live import LiveConfig, LiveTrainer, train_online
from torchloom.live.report import LiveRecord

from ..helpers import assert_close


def small_net(seed: int = 0, widths=(6, 12, 4)) -> Network:
    torch.manual_seed(seed)
    layers = [Dense(widths[i], widths[i + 1], activation="linear" if i == len(widths) - 2 else "tanh") for i in range(len(widths) - 1)]
    return Network(*layers)


def stream(n: int, seed: int = 1, dim: int = 6, classes: int = 4):
    g = torch.Generator().manual_seed(seed)
    x = torch.rand(n, dim, generator=g) * 2 - 1
    teacher = torch.rand(classes, dim, generator=g) * 2 - 1
    return x, (x @ teacher.T).argmax(-1)


def reference_forward(params: list[torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    """Dense tanh → linear in float64 from the raw weights (``[out, in]``) and biases."""
    h = x.double()
    for i in range(0, len(params), 2):
        h = h @ params[i].double().T + params[i + 1].double()
        if i < len(params) - 2:
            h = torch.tanh(h)
    return h


def reference_sgd(params: list[torch.Tensor], x: torch.Tensor, label: int, lr: float, classes: int = 4) -> list[torch.Tensor]:
    """One SGD step on mean((out − onehot)²) by torch autograd, float64."""
    ps = [p.detach().double().clone().requires_grad_(True) for p in params]
    out = reference_forward(ps, x)
    target = torch.zeros_like(out)
    target[0, label] = 1.0
    ((out - target) ** 2).mean().backward()
    return [(p - lr * p.grad).detach() for p in ps]


def test_late_labels_score_the_served_prediction_and_train_in_label_order():
    """Three samples served before any label comes; labels come in the order 2, 0, 1. Each prediction
    is the forward at the weights when it was served; the updates follow the labels' order (checked
    against autograd SGD in float64)."""
    net = small_net()
    params = [p.detach().clone() for p in net.parameters()]
    live = LiveTrainer(net, method="backprop", learning_rate=0.1)
    x, y = stream(3)
    served = [live.serve(x[i]) for i in range(3)]
    for pred, _ in served:
        assert pred.shape == (1, 4)
    for i in range(3):
        assert_close(served[i][0], reference_forward(params, x[i : i + 1]), name=f"prediction {i}", rtol=1e-5, atol=1e-6)
    ref = params
    for i in (2, 0, 1):
        live.learn(served[i][1], int(y[i]))
        ref = reference_sgd(ref, x[i : i + 1], int(y[i]), 0.1)
    for got, want in zip(live.model.parameters(), ref):
        assert_close(got, want, name="weights after the late labels", rtol=1e-5, atol=1e-6)
    rep = live.report(window_samples=3)
    assert rep.samples == 3 and live.version == 3
    assert rep.trained_fraction == 1.0
    assert rep.staleness_max == 0  # serial: served from the trained weights
    hits = [int(served[i][0].argmax()) == int(y[i]) for i in range(3)]
    assert rep.lucy.total_correct == sum(hits)
    with pytest.raises(ValueError, match=r"learn: Ticket\(rows=0..0, version=0, learned=True\) was already given its label"):
        live.learn(served[0][1], 0)


@pytest.mark.parametrize("lean", [False, True])
def test_backprop_reuses_the_serve_forward(lean):
    """Served and trained at the same weights, backprop's update runs no forward of its own (the
    method's step, and the lean step)."""
    net = small_net()
    live = LiveTrainer(net, method="backprop", lean=lean)
    assert (live._lean is not None) == lean
    calls = []
    owner = live._lean if lean else live.model
    real = owner.forward if lean else owner.forward_saved
    setattr(owner, "forward" if lean else "forward_saved", lambda x: (calls.append(1), real(x))[1])
    x, y = stream(5)
    for i in range(5):
        _, t = live.serve(x[i])
        live.learn(t, int(y[i]))
    assert len(calls) == 5  # one forward per sample: the serve's


@pytest.mark.parametrize("name", method_names())
def test_every_method_through_the_live_loop_equals_train(name):
    """For every registered method: the live loop (schedule "sample") applies the same updates as
    train() over the same samples as batches of one, in the same order (one epoch)."""
    x, y = stream(24, seed=3)
    hot = torch.nn.functional.one_hot(y, 4).float()
    net_live, net_train = small_net(5), small_net(5)
    torch.manual_seed(11)  # a method that draws at bind (random feedback weights) draws the same in both
    live = LiveTrainer(net_live, method=name, learning_rate=0.05)
    for i in range(24):
        _, t = live.serve(x[i])
        live.learn(t, int(y[i]))
    torch.manual_seed(11)
    train(net_train, [(x[i : i + 1], hot[i : i + 1]) for i in range(24)],
          TrainingConfig(method=name, epochs=1, learning_rate=0.05, loss_type="mse", verbose=0))
    for (n, got), want in zip(net_live.named_parameters(), net_train.parameters()):
        assert torch.isfinite(got).all(), n
        assert_close(got, want, name=f"{name}: {n}", rtol=1e-5, atol=1e-6)
    assert live.version == live.statuses["OK"]
    assert any(not torch.equal(a, b) for a, b in zip(net_live.parameters(), small_net(5).parameters())), f"{name} never updated"


def _run(live: LiveTrainer, x: torch.Tensor, y: torch.Tensor) -> list[torch.Tensor]:
    preds = []
    for i in range(len(y)):
        p, t = live.serve(x[i])
        preds.append(p.clone())
        live.learn(t, int(y[i]))
    return preds


@pytest.mark.parametrize("schedule", [{"schedule": "sample"}, {"schedule": "batch", "batch_size": 3}])
def test_overlap_with_staleness_zero_equals_serial(schedule):
    x, y = stream(30, seed=4)
    serial = LiveTrainer(small_net(7), method="backprop", **schedule)
    overlap = LiveTrainer(small_net(7), method="backprop", overlap=True, max_staleness=0, **schedule)
    for i, (a, b) in enumerate(zip(_run(serial, x, y), _run(overlap, x, y))):
        assert torch.equal(a, b), f"prediction {i} differs"
    for a, b in zip(serial.model.parameters(), overlap.model.parameters()):
        assert torch.equal(a, b)
    assert overlap.report(window_samples=10).staleness_max == 0


def test_overlap_with_staleness_one_serves_the_weights_before_the_last_update():
    """max_staleness=1: each prediction is the forward at the weights before the latest update."""
    x, y = stream(12, seed=6)
    live = LiveTrainer(small_net(8), method="backprop", overlap=True, max_staleness=1)
    history = [[p.detach().clone() for p in live.model.parameters()]]  # weights after each update
    for i in range(12):
        p, t = live.serve(x[i])
        lag = max(len(history) - 2, 0)  # the snapshot was taken just before the last update
        assert_close(p, reference_forward(history[lag], x[i : i + 1]), name=f"prediction {i}", rtol=1e-5, atol=1e-6)
        live.learn(t, int(y[i]))
        history.append([q.detach().clone() for q in live.model.parameters()])
    rep = live.report(window_samples=12)
    assert rep.staleness_max == 1 and rep.staleness_mean == pytest.approx(11 / 12)


def test_batch_schedule_updates_every_k_labels_and_flush_trains_the_rest():
    x, y = stream(10, seed=2)
    live = LiveTrainer(small_net(), method="backprop", schedule="batch", batch_size=4)
    steps = [live.learn(live.serve(x[i])[1], int(y[i])) for i in range(10)]
    assert steps == [0, 0, 0, 1, 0, 0, 0, 1, 0, 0]
    assert live.report().trained_fraction == pytest.approx(0.8)
    assert live.flush() == 1 and live.version == 3
    assert live.report().trained_fraction == 1.0


def test_periodic_schedule_takes_the_newest_samples_every_period():
    """Loom's periodic batch with a test clock: an update when 50 ms have passed, on the newest 20
    waiting samples; older ones are dropped (untrained)."""
    now = [0.0]
    x, y = stream(60, seed=2)
    live = LiveTrainer(small_net(), method="backprop", schedule="periodic", clock=lambda: now[0])
    steps = []
    for i in range(60):
        now[0] = i * 0.002  # 2 ms a sample: 25 samples per period
        steps.append(live.learn(live.serve(x[i])[1], int(y[i])))
    assert [i for i, s in enumerate(steps) if s] == [0, 25, 50]
    trained = live.record.trained
    # at 25: samples 1-25 wait, the newest 20 (6-25) train; at 50: 26-50 wait, 31-50 train
    assert trained[0] and not any(trained[1:6]) and all(trained[6:26]) and not any(trained[26:31])
    assert all(trained[31:51]) and not any(trained[51:])
    assert live.report().trained_fraction == pytest.approx((1 + 20 + 20) / 60)


def test_device_stream_window_equals_serve_and_learn_per_sample():
    """The device-resident stream (eager on CPU): K samples per call, each served then trained with
    the method's device step; the same predictions and weights as serve/learn one by one."""
    x, y = stream(16, seed=9)
    serial = LiveTrainer(small_net(3), method="backprop")
    preds = torch.cat(_run(serial, x, y))
    windowed = LiveTrainer(small_net(3), method="backprop")
    got = torch.cat([windowed.stream_window(x[k : k + 8], y[k : k + 8]).clone() for k in (0, 8)])
    assert_close(got, preds, name="stream predictions", rtol=1e-5, atol=1e-6)
    for a, b in zip(windowed.model.parameters(), serial.model.parameters()):
        assert_close(a, b, name="stream weights", rtol=1e-5, atol=1e-6)
    rep = windowed.report(window_samples=8)
    assert rep.samples == 16 and windowed.version == 16 and rep.trained_fraction == 1.0
    assert rep.lucy.total_correct == serial.report().lucy.total_correct


def test_shock_statistics_from_a_known_record():
    """Phase A: 100 right answers; phase B: 40 wrong, then right. Pre-shock accuracy 100 %; the
    worst 50-sample window holds the 40 wrong ones (20 %); recovery counts the samples from the
    shock to the end of the first 50-sample window at 80 % / 90 % of 100 %."""
    rec = LiveRecord()
    correct = [1] * 100 + [0] * 40 + [1] * 160
    for i, c in enumerate(correct):
        row = rec.add_serve(i * 0.01, "A" if i < 100 else "B", 1e-5, 1e-5, 0)
        rec.correct[row] = c
    rec.duration_s = 3.0
    rep = rec.report(window_s=1.0, window=50, pre_samples=500)
    (shock,) = rep.shocks
    assert shock.at == 100 and shock.phase == "B" and shock.pre_accuracy == 100.0
    assert shock.min_accuracy == 20.0
    # the window of samples [n, n + 50) of the phase: (n + 10) / 50 right for n <= 40 → 80 % at n = 30, 90 % at n = 35
    assert shock.recover_80 == 80 and shock.recover_90 == 85
    assert rep.window_accuracy == [100.0, 60.0, 100.0]
    assert rep.flips == [(100.0, 60.0, 0)]


def test_report_csv_and_observers(tmp_path):
    seen = []

    class Obs:
        def on_epoch_end(self, trainer, epoch, logs):
            seen.append((epoch, logs))

        def on_train_end(self, trainer, report):
            seen.append(("end", report.samples))

    x, y = stream(25, seed=2)
    live = LiveTrainer(small_net(), observers=[Obs()], log_every=10)
    for i in range(25):
        if i == 12:
            live.set_phase("avoid")
        live.learn(live.serve(x[i])[1], int(y[i]))
    rep = live.close()
    assert [s[0] for s in seen] == [0, 1, "end"] and seen[-1][1] == 25
    assert seen[0][1]["samples"] == 10.0 and isinstance(seen[0][1]["acc"], float)
    path = tmp_path / "live.csv"
    rep.to_csv(path)
    rows = list(csv.DictReader(open(path)))
    assert len(rows) == len(rep.lucy.windows)
    assert sum(int(r["outputs"]) for r in rows) == 25
    assert sum(int(r["phase_switches"]) for r in rows) == 1
    assert len(rep.shocks) == 1 and "shock0_min_acc" in rep.logs()


def test_train_online_progressive_validation():
    x, y = stream(40, seed=5)
    items = [(x[i], int(y[i]), "chase" if i < 20 else "avoid") for i in range(40)]
    rep = train_online(small_net(), items, LiveConfig(method="backprop"), report_options={"window_samples": 10})
    assert rep.samples == 40 and len(rep.lucy.windows) == 4 and len(rep.shocks) == 1
    with pytest.raises(ValueError, match=r"train_online: stream item 0 must be \(x, y\) or \(x, y, phase\), got int"):
        train_online(small_net(), [1, 2])


def test_bad_settings_and_input():
    net = small_net()
    with pytest.raises(ValueError, match=r"LiveConfig: schedule must be one of 'sample', 'batch', 'periodic', got 'often'"):
        LiveTrainer(net, schedule="often")
    with pytest.raises(ValueError, match=r"LiveConfig: max_staleness must be 0 or 1 \(weight versions\), got 2"):
        LiveTrainer(net, max_staleness=2)
    with pytest.raises(ValueError, match=r"LiveConfig: batch_size must be an int >= 1, got 0"):
        LiveTrainer(net, batch_size=0)
    with pytest.raises(TypeError, match=r"LiveTrainer got unknown setting\(s\) \['epochs'\]"):
        LiveTrainer(net, epochs=3)
    live = LiveTrainer(net)
    p, t = live.serve(torch.zeros(6))
    with pytest.raises(ValueError, match=r"learn: class labels must lie in \[0, 4\), got \[7\]"):
        live.learn(t, 7)
    with pytest.raises(ValueError, match=r"learn: a target must have the prediction's shape \[1, 4\], got \[1, 3\]"):
        live.learn(t, torch.zeros(1, 3))
    with pytest.raises(TypeError, match=r"learn: ticket must be a Ticket from serve\(\), got int"):
        live.learn(3, 1)
    with pytest.raises(TypeError, match=r"serve: x must be a floating tensor, got dtype torch.int64"):
        live.serve(torch.zeros(6, dtype=torch.long))
    assert live.version == 0 and not t.learned  # nothing changed


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("overlap", [False, True])
def test_cuda_graphs_serve_and_train_like_the_cpu_loop(overlap):
    x, y = stream(40, seed=4)
    cpu = LiveTrainer(small_net(7), method="backprop")
    gpu = LiveTrainer(small_net(7).cuda(), method="backprop", overlap=overlap, max_staleness=1 if overlap else 0)
    ref = _run(cpu, x, y)
    got = _run(gpu, x.cuda(), y)
    rep = gpu.report(window_samples=10)
    assert rep.staleness_max <= 1
    if not overlap:
        for i, (a, b) in enumerate(zip(got, ref)):
            assert_close(a.cpu(), b, name=f"prediction {i}", rtol=1e-4, atol=1e-5)
    for a, b in zip(gpu.model.parameters(), cpu.model.parameters()):
        assert torch.isfinite(a).all()
        if not overlap:
            assert_close(a.cpu(), b, name="weights", rtol=1e-4, atol=1e-5)
    assert gpu.cuda.update is not None and gpu.cuda.update.graph is not None  # the update was captured


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("fused", [True, False])
def test_cuda_device_stream_is_one_launch(fused):
    """One kernel per window (backprop's SGD on a Dense chain), or one CUDA graph of the method's
    device steps (the kernel off: the torch-op steps)."""
    x, y = stream(64, seed=9)
    live = LiveTrainer(small_net(3).cuda(), method="backprop")
    if not fused:
        live.engine.kernel_backend = "reference"
    for k in range(0, 64, 16):
        live.stream_window(x[k : k + 16].cuda(), y[k : k + 16].cuda())
    assert (live._stream.fused is not None) == fused
    assert fused or live._stream.graph is not None
    serial = LiveTrainer(small_net(3), method="backprop")
    _run(serial, x, y)
    for a, b in zip(live.model.parameters(), serial.model.parameters()):
        assert_close(a.cpu(), b, name="stream weights", rtol=1e-4, atol=1e-5)


def _eager_cuda(live: LiveTrainer):
    """The CUDA per-sample logic (``CudaLive``) on the CPU: ``EagerOps`` graphs re-run their function
    at each replay and count the replays; events count the host waits."""
    from torchloom.live.device import CudaLive, EagerOps

    ops = EagerOps()
    live.cuda = CudaLive(live, ops=ops)
    live._lean = None
    live._lean_serve = False
    return ops


@pytest.mark.parametrize("overlap", [False, True])
def test_cuda_logic_on_the_cpu_one_replay_each_and_the_cpu_loop_numbers(overlap):
    """Per sample: one serve-graph replay, one wait on the serve's read-back, one update-graph replay
    (after the first, eager, update); predictions come back as host tensors. Serial: the predictions
    and weights of the CPU loop; overlap (staleness 1): each prediction from the weights before the
    latest update."""
    n = 12
    x, y = stream(n, seed=4)
    cpu = LiveTrainer(small_net(7), method="backprop")
    ref = _run(cpu, x, y)
    live = LiveTrainer(small_net(7), method="backprop", overlap=overlap, max_staleness=1)
    ops = _eager_cuda(live)
    history = [[p.detach().clone() for p in live.model.parameters()]]
    got = []
    for i in range(n):
        syncs = ops.host_syncs
        p, t = live.serve(x[i])
        assert p.device.type == "cpu" and ops.host_syncs == syncs + 1  # the read-back of this serve only
        got.append(p)
        if overlap:
            lag = max(len(history) - 2, 0)
            assert_close(p, reference_forward(history[lag], x[i : i + 1]), name=f"prediction {i}", rtol=1e-5, atol=1e-6)
        live.learn(t, int(y[i]))
        history.append([q.detach().clone() for q in live.model.parameters()])
    serve_replays = sum(g.replays for g in ops.graphs if g.fn.__name__ == "<lambda>")
    update = live.cuda.update
    assert serve_replays == n and update.graph is not None and update.graph.replays == n - 1
    rep = live.report(window_samples=n)
    assert rep.staleness_max == (1 if overlap else 0) and live.version == n
    if not overlap:
        for i, (a, b) in enumerate(zip(got, ref)):
            assert_close(a, b, name=f"prediction {i}", rtol=1e-5, atol=1e-6)
        for a, b in zip(live.model.parameters(), cpu.model.parameters()):
            assert_close(a, b, name="weights", rtol=1e-5, atol=1e-6)


def test_cuda_logic_counts_a_refused_update_inside_the_update_graph():
    x, y = stream(6, seed=2)
    live = LiveTrainer(small_net(3), method="backprop")
    _eager_cuda(live)
    _run(live, x[:4], y[:4])
    before = [p.detach().clone() for p in live.model.parameters()]
    _, t = live.serve(torch.full((6,), float("nan")))
    live.learn(t, 1)  # the device guard refuses it: the weights stay, the count is kept on the device
    assert int(live.cuda.skipped) == 1 and live.version == 5
    for a, b in zip(live.model.parameters(), before):
        assert torch.equal(a, b)
    live.report()
    assert live.version == 4 and live.statuses["OK"] == 4 and int(live.cuda.skipped) == 0


def test_stream_window_captured_logic_on_the_cpu_takes_predictions_from_the_steps_forward():
    """The captured device-resident window (EagerOps on the CPU): after the first (eager) window, one
    replay per window, no serve forward of its own (the prediction is the method's pre-update forward
    of the sample), the predictions and weights of serve + learn sample by sample."""
    x, y = stream(32, seed=9)
    serial = LiveTrainer(small_net(3), method="backprop")
    preds = torch.cat(_run(serial, x, y))
    live = LiveTrainer(small_net(3), method="backprop")
    _eager_cuda(live)
    forwards = []
    real = live.model.forward
    live.model.forward = lambda t: (forwards.append(1), real(t))[1]
    got = []
    for k in range(0, 32, 8):
        got.append(live.stream_window(x[k : k + 8], y[k : k + 8]).clone())
        if k == 0:
            assert len(forwards) == 8  # the eager window serves with the model
    window = live._stream
    assert window.reuse_forward and window.graph is not None and window.graph.replays == 3
    assert len(forwards) == 8  # the captured windows run no serve forward of their own
    assert_close(torch.cat(got), preds, name="stream predictions", rtol=1e-5, atol=1e-6)
    for a, b in zip(live.model.parameters(), serial.model.parameters()):
        assert_close(a, b, name="stream weights", rtol=1e-5, atol=1e-6)
    assert live.version == 32


@pytest.mark.parametrize("fused", [False, True])
def test_stream_window_reads_each_window_during_the_next(fused):
    """With a device queue (EagerOps standing in for CUDA on the CPU), ``stream_window`` does not wait
    for the window it queues: host windows go through the two staging buffers, a window's rows are
    read during the next call, ``report`` reads the last; the predictions, weights and scores are serve
    + learn's. ``fused``: the window kernel (Triton's interpreter), else the captured method's steps."""
    x, y = stream(32, seed=9)
    serial = LiveTrainer(small_net(3), method="backprop")
    preds = torch.cat(_run(serial, x, y))
    live = LiveTrainer(small_net(3), method="backprop")
    if fused:
        pytest.importorskip("triton")
        live.engine.kernel_backend = "triton"
    _eager_cuda(live)
    got, rows = [], []
    for k in range(0, 32, 8):
        got.append(live.stream_window(x[k : k + 8], y[k : k + 8]).clone())
        rows.append(len(live.record))
    assert (live._stream.fused is not None) == fused
    assert rows == [0, 8, 16, 24] and live._window is not None
    assert len(live._stream._stages) == 2 and len(live._stream._host) == 2
    rep = live.report(window_samples=8)
    assert live._window is None and rep.samples == 32 and rep.trained_fraction == 1.0
    assert rep.lucy.total_correct == serial.report().lucy.total_correct
    assert live.version == 32 and live.statuses["OK"] == 32
    assert_close(torch.cat(got), preds, name="stream predictions", rtol=1e-5, atol=1e-6)
    for a, b in zip(live.model.parameters(), serial.model.parameters()):
        assert_close(a, b, name="stream weights", rtol=1e-5, atol=1e-6)


def test_stream_window_corrects_the_count_when_it_reads_a_refused_update():
    """A window's updates count as applied when it is queued; reading its statuses takes back the
    ones the device refused (a NaN sample), in the version and the step counts."""
    x, y = stream(16, seed=9)
    x[11] = float("nan")
    live = LiveTrainer(small_net(3), method="backprop")
    _eager_cuda(live)
    live.stream_window(x[:8], y[:8])
    live.stream_window(x[8:], y[8:])
    assert live.version == 16 and live.statuses["OK"] == 16  # the second window is not read yet
    live.flush()
    bad = int((live._stream.statuses() != 0).sum())
    assert bad >= 1 and live.statuses["NAN_GRAD"] == bad
    assert live.version == live.statuses["OK"] == 16 - bad


def test_stream_window_logs_each_read_window_once():
    """An observer's report during a window's read (``log_every``) reads no further window, and each
    window is logged once: epochs 0..3 for 4 windows of 8 at ``log_every=8``."""
    seen = []

    class Watch:
        def on_epoch_end(self, trainer, epoch, logs):
            seen.append((epoch, len(trainer.record)))

    x, y = stream(32, seed=9)
    live = LiveTrainer(small_net(3), method="backprop", observers=[Watch()], log_every=8)
    _eager_cuda(live)
    for k in range(0, 32, 8):
        live.stream_window(x[k : k + 8], y[k : k + 8])
    assert seen == [(0, 8), (1, 16), (2, 24)]
    live.report()
    assert seen == [(0, 8), (1, 16), (2, 24), (3, 32)]


def test_learning_rate_unset_is_0_05_by_name_and_a_configs_own_rate():
    """LiveConfig.learning_rate=None: 0.05 for a method by name (Welvet adaptv2's rate); a method
    config instance keeps its own rate (automatic or given), and a number given beside it must equal it."""
    from torchloom import TweenConfig
    from torchloom.optim import SGD

    assert LiveConfig().learning_rate is None
    assert LiveTrainer(small_net(), method="backprop").engine.optimizer.param_groups[0]["lr"] == 0.05
    assert LiveTrainer(small_net(), method="tween").method.config.base_rate == 0.05
    assert LiveTrainer(small_net(), method=TweenConfig()).method.config.base_rate is None  # the automatic rate
    assert LiveTrainer(small_net(), method=TweenConfig(base_rate=0.2), learning_rate=0.2).method.config.base_rate == 0.2
    net = small_net()
    live = LiveTrainer(net, method="backprop", optimizer=SGD(net.parameters(), lr=0.3))
    assert live.engine.optimizer.param_groups[0]["lr"] == 0.3
    with pytest.raises(ValueError, match=r"^TrainingConfig: learning_rate=0\.1 disagrees with the method config's base_rate=None"):
        LiveTrainer(small_net(), method=TweenConfig(), learning_rate=0.1)
    with pytest.raises(ValueError, match=r"^LiveConfig: learning_rate must be a finite number > 0 or None \(0\.05, or a method "
                       r"config's or optimizer's own rate\), got nan$"):
        LiveTrainer(small_net(), learning_rate=float("nan"))
