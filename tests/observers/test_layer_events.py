"""Per-layer events and ConsoleObserver (SPEC §10): Loom's exact line format, numbers checked against
statistics computed independently (numpy; torch autograd in float64 on a copy of the network), the
order and meaning of the events, throttling, and that the observed step trains exactly as the lean
one."""

import copy
import io
import re

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from torchloom.layers.dense import Dense
from torchloom.layers.network import Network
from torchloom.observers import layer_stats as layer_stats_module
from torchloom.observers.base import Observer
from torchloom.observers.console import ConsoleObserver
from torchloom.observers.layer_stats import LayerEvents, layer_stats
from torchloom.engine.train import TrainingConfig, train

FWD = re.compile(r"^\[FWD\] \((\d+),(\d+),(\d+),(\d+)\) (\w+): avg=(-?\d+\.\d{4}) max=(-?\d+\.\d{4}) active=(\d+)/(\d+)$")
BWD = re.compile(r"^\[BWD\] \((\d+),(\d+),(\d+),(\d+)\) (\w+): grad_avg=(-?\d+\.\d{4}) grad_max=(-?\d+\.\d{4})$")

ACTS = [torch.relu, torch.tanh, lambda t: t]  # the three layers' activations, torch's own functions


def _net():
    return Network(Dense(4, 16, "relu"), Dense(16, 8, "tanh"), Dense(8, 3))


def _batch(bs=10):
    g = torch.Generator().manual_seed(1)
    return torch.randn(bs, 4, generator=g), torch.randn(bs, 3, generator=g)


def _reference(net, x, y):
    """float64 autograd on a copy: each layer's output and the gradient of the MSE loss w.r.t. each
    layer's input (index 0 = the network input)."""
    x = x.double().requires_grad_(True)
    inputs, outputs = [], []
    h = x
    for layer, act in zip(net.layers, ACTS):
        if h is not x:
            h.retain_grad()
        inputs.append(h)
        h = act(F.linear(h, layer.weight.detach().double(), layer.bias.detach().double()))
        outputs.append(h)
    F.mse_loss(h, y.double()).backward()
    return [o.detach() for o in outputs], [i.grad for i in inputs]


def _check_stats(name, avg, mx, t, active=None, total=None):
    a = t.numpy()
    assert abs(float(avg) - a.mean()) <= 6e-5, f"{name}: avg {avg} vs {a.mean():.6f}"
    assert abs(float(mx) - a.max()) <= 6e-5, f"{name}: max {mx} vs {a.max():.6f}"
    if active is not None:
        assert int(active) == int((np.abs(a) > 1e-6).sum()), f"{name}: active {active}"
        assert int(total) == a.size, f"{name}: total {total} vs {a.size}"


def test_console_lines_match_loom_format_and_independent_stats():
    net = _net()
    ref_net = copy.deepcopy(net)
    x, y = _batch()
    buf = io.StringIO()
    train(net, [(x, y)], TrainingConfig(epochs=1, learning_rate=0.1, verbose=0, observers=[ConsoleObserver(stream=buf)]))
    lines = buf.getvalue().splitlines()
    assert len(lines) == 6, lines

    outputs, input_grads = _reference(ref_net, x, y)
    # forward: first layer first, at (0,0,i,0), stats of the layer's output
    for i, line in enumerate(lines[:3]):
        m = FWD.match(line)
        assert m, f"forward line {i} does not match Loom's format: {line!r}"
        z, yy, xx, l, typ, avg, mx, active, total = m.groups()
        assert (int(z), int(yy), int(xx), int(l)) == (0, 0, i, 0)
        assert typ == "Dense"
        _check_stats(f"forward layer {i}", avg, mx, outputs[i], active, total)
    # backward: last layer first, stats of the gradient w.r.t. the layer's input
    for k, line in enumerate(lines[3:]):
        i = 2 - k
        m = BWD.match(line)
        assert m, f"backward line for layer {i} does not match Loom's format: {line!r}"
        z, yy, xx, l, typ, avg, mx = m.groups()
        assert (int(z), int(yy), int(xx), int(l)) == (0, 0, i, 0)
        assert typ == "Dense"
        _check_stats(f"backward layer {i}", avg, mx, input_grads[i])


def test_relu_layer_active_count_is_not_trivial():
    # the relu layer's output must have zeros, so active < total is really checked above
    net = _net()
    x, _ = _batch()
    with torch.no_grad():
        h = net.layers[0].forward_saved(x)[0]
    assert 0 < int((h.abs() > 1e-6).sum()) < h.numel()


def test_layer_stats_against_numpy():
    t = torch.tensor([[0.0, -2.5, 1e-7], [3.0, -1e-7, 0.5]], dtype=torch.float32)
    s = layer_stats(t)
    a = t.double().numpy()
    assert s.avg == pytest.approx(a.mean(), abs=1e-12)
    assert s.std == pytest.approx(a.std(ddof=0), abs=1e-12)  # population std, as Loom
    assert (s.min, s.max) == (a.min(), a.max())
    assert (s.active, s.total) == (3, 6)  # |v| > 1e-6: -2.5, 3.0, 0.5
    assert isinstance(s.avg, float) and isinstance(s.active, int)
    empty = layer_stats(torch.empty(0))
    assert (empty.avg, empty.std, empty.min, empty.max, empty.active, empty.total) == (0.0, 0.0, 0.0, 0.0, 0, 0)


def test_observed_training_equals_lean_training():
    net_a, x_batches = _net(), [_batch(7), _batch(5)]
    net_b = copy.deepcopy(net_a)
    cfg = dict(epochs=3, learning_rate=0.05, verbose=0)
    ra = train(net_a, x_batches, TrainingConfig(**cfg))
    rb = train(net_b, x_batches, TrainingConfig(**cfg, observers=[ConsoleObserver(stream=io.StringIO())]))
    assert ra.loss_history == rb.loss_history
    for i, (pa, pb) in enumerate(zip(net_a.parameters(), net_b.parameters())):
        assert torch.equal(pa, pb), f"param {i} differs between observed and lean training"


def test_console_every_n_steps_and_stats_only_when_printed(monkeypatch):
    calls = []
    real = layer_stats_module.layer_stats
    monkeypatch.setattr(layer_stats_module, "layer_stats", lambda t: calls.append(1) or real(t))
    buf = io.StringIO()
    batches = [_batch(4) for _ in range(5)]
    train(_net(), batches, TrainingConfig(epochs=1, learning_rate=0.01, verbose=0, observers=[ConsoleObserver(every=2, stream=buf)]))
    lines = buf.getvalue().splitlines()
    assert len(lines) == 3 * 6  # steps 0, 2, 4; 3 layers × (forward + backward)
    assert len(calls) == 3 * 6  # statistics computed only for the lines printed


def test_event_fields_and_step_numbers():
    seen = []

    class Recorder:  # not an Observer subclass: dispatch is by method name
        def on_layer_forward(self, event):
            seen.append(("F", event.step, event.index, event.position, event.layer_type, tuple(event.tensor.shape)))

        def on_layer_backward(self, event):
            seen.append(("B", event.step, event.index, event.position, event.layer_type, tuple(event.tensor.shape)))

    train(_net(), [_batch(6), _batch(6)], TrainingConfig(epochs=1, verbose=0, observers=[Recorder()]))
    expected = []
    for step in (0, 1):
        expected += [("F", step, i, (0, 0, i, 0), "Dense", (6, (16, 8, 3)[i])) for i in range(3)]
        expected += [("B", step, i, (0, 0, i, 0), "Dense", (6, (4, 16, 8)[i])) for i in (2, 1, 0)]
    assert seen == expected


def test_only_forward_listener_gets_no_backward_events():
    fwd = []

    class ForwardOnly(Observer):
        def on_layer_forward(self, event):
            fwd.append(event.index)

    train(_net(), [_batch()], TrainingConfig(epochs=1, verbose=0, observers=[ForwardOnly()]))
    assert fwd == [0, 1, 2]


def test_layer_events_in_a_manual_loop():
    # the helper trainers (and users) call directly: forward_record + backward with events
    net = _net()
    ref = copy.deepcopy(net)
    x, y = _batch()
    buf = io.StringIO()
    events = LayerEvents([ConsoleObserver(stream=buf)], step=0)
    out = events.run_forward(net, x)
    grads = events.run_backward(net, 2 * (out - y) / out.numel())
    lines = buf.getvalue().splitlines()
    assert [ln[:5] for ln in lines] == ["[FWD]"] * 3 + ["[BWD]"] * 3
    outputs, input_grads = _reference(ref, x, y)
    m = BWD.match(lines[-1])
    _check_stats("manual backward layer 0", m.group(6), m.group(7), input_grads[0])
    assert len(grads) == len(list(net.parameters())) and all(g is p.grad for g, p in zip(grads, net.parameters()))


def test_console_observer_rejects_bad_every():
    for bad in (0, -1, 1.5, True, "2"):
        with pytest.raises(ValueError, match="every must be an int >= 1"):
            ConsoleObserver(every=bad)


def test_input_without_gradient_sends_no_backward_event():
    # e.g. an Embedding's integer ids: its backward returns no input gradient
    seen = []

    class Recorder:
        def on_layer_backward(self, event):
            seen.append(event.index)

    events = LayerEvents([Recorder()])
    events.backward(0, Dense(2, 2), None)
    events.backward(1, Dense(2, 2), torch.ones(3, 2))
    assert seen == [1]
