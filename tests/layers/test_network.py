"""Network: autograd mode, Loom mode (history + manual loop), against torch autograd in float64."""

import pytest
import torch
import torch.nn.functional as F

from helpers import assert_close
from torchloom.layers.dense import Dense
from torchloom.layers.network import Network, Sequential


def _net(record=False):
    return Network(
        Dense(4, 6, "tanh", dtype=torch.float64),
        Dense(6, 5, "relu", dtype=torch.float64),
        Dense(5, 3, "sigmoid", bias=False, dtype=torch.float64),
        record_history=record,
    )


def _reference(net, x):
    """The same network written with torch.nn.functional, for autograd."""
    l0, l1, l2 = net
    h = torch.tanh(F.linear(x, l0.weight, l0.bias))
    h = torch.relu(F.linear(h, l1.weight, l1.bias))
    return torch.sigmoid(F.linear(h, l2.weight))


def test_autograd_mode_matches_functional_reference():
    net = _net()
    x = torch.randn(8, 4, dtype=torch.float64)
    y = net(x)
    assert y.requires_grad and net.history is None
    g = torch.randn_like(y)
    y.backward(g)
    got = [p.grad.clone() for p in net.parameters()]
    net.zero_grad()
    _reference(net, x).backward(g)
    for i, (a, p) in enumerate(zip(got, net.parameters())):
        assert_close(a, p.grad, name=f"param {i}", rtol=1e-12, atol=1e-12)


def test_loom_mode_records_history_and_backward_fills_grads():
    net = _net(record=True)
    x = torch.randn(8, 4, dtype=torch.float64)
    y = net(x)
    assert not y.requires_grad
    h = net.history
    assert len(h) == 3 and h[0].input is x and h[-1].output is y
    assert_close(h[0].pre, F.linear(x, net[0].weight, net[0].bias), name="pre0", rtol=1e-12, atol=1e-12)
    assert_close(h[1].output, torch.relu(h[1].pre), name="out1", rtol=0, atol=0)
    acts = net.forward_acts
    assert len(acts) == 4 and acts[0] is x and acts[3] is y

    g = torch.randn_like(y)
    gx = net.backward(g, input_grad=True)
    got = [p.grad.clone() for p in net.parameters()]

    xr = x.clone().requires_grad_(True)
    params = list(net.parameters())
    ref = torch.autograd.grad(_reference(net, xr), [xr, *params], g)
    assert_close(gx, ref[0], name="grad_x", rtol=1e-12, atol=1e-12)
    for i, (a, r) in enumerate(zip(got, ref[1:])):
        assert_close(a, r, name=f"param {i}", rtol=1e-12, atol=1e-12)
    assert net.backward(g) is None  # input gradient only when asked


def test_backward_overwrites_instead_of_accumulating():
    net = _net(record=True)
    x = torch.randn(3, 4, dtype=torch.float64)
    g = torch.randn_like(net(x))
    net.backward(g)
    first = [p.grad.clone() for p in net.parameters()]
    net.backward(g)
    for a, p in zip(first, net.parameters()):
        assert torch.equal(a, p.grad)


def test_on_layer_callbacks_see_every_layer_in_order():
    net = _net()
    seen_f, seen_b = [], []
    y = net.forward_record(torch.randn(2, 4, dtype=torch.float64), on_layer=lambda i, l, r: seen_f.append((i, r.output.shape)))
    net.backward(torch.ones_like(y), on_layer=lambda i, l, g: seen_b.append((i, g.shape)))
    assert [i for i, _ in seen_f] == [0, 1, 2] and [i for i, _ in seen_b] == [2, 1, 0]
    assert seen_b[0][1] == (2, 3) and seen_b[2][1] == (2, 6)


def test_apply_gradients_is_plain_sgd():
    net = _net(record=True)
    y = net(torch.randn(5, 4, dtype=torch.float64))
    net.backward(torch.randn_like(y))
    before = [(p.detach().clone(), p.grad.clone()) for p in net.parameters()]
    net.apply_gradients(0.1)
    for (w, g), p in zip(before, net.parameters()):
        assert_close(p, w - 0.1 * g, name="w", rtol=1e-15, atol=1e-15)
    with pytest.raises(ValueError, match="lr must be a finite number > 0, got -1"):
        net.apply_gradients(-1)


def test_clip_gradients_matches_torch_clip_grad_norm():
    net = _net(record=True)
    y = net(torch.randn(5, 4, dtype=torch.float64))
    net.backward(100 * torch.randn_like(y))
    grads = [p.grad.clone() for p in net.parameters()]
    ref_params = [torch.nn.Parameter(torch.zeros_like(g)) for g in grads]
    for rp, g in zip(ref_params, grads):
        rp.grad = g.clone()
    ref_norm = torch.nn.utils.clip_grad_norm_(ref_params, 0.5)
    norm = net.clip_gradients(0.5)
    assert abs(norm - ref_norm.item()) < 1e-9 * ref_norm.item()
    for p, rp in zip(net.parameters(), ref_params):
        assert_close(p.grad, rp.grad, name="clipped", rtol=1e-6, atol=1e-12)
    # below the threshold nothing changes
    before = [p.grad.clone() for p in net.parameters()]
    net.clip_gradients(1e9)
    assert all(torch.equal(a, p.grad) for a, p in zip(before, net.parameters()))


def test_gradient_stats_are_the_per_layer_numbers(capsys):
    net = _net(record=True)
    y = net(torch.randn(5, 4, dtype=torch.float64))
    net.backward(torch.randn_like(y))
    stats = net.gradient_stats()
    assert [s["layer"] for s in stats] == [0, 1, 2]
    for s, layer in zip(stats, net):
        g = torch.cat([p.grad.flatten() for p in layer.parameters()])
        assert s["type"] == "Dense"
        assert s["min"] == pytest.approx(g.min().item()) and s["max"] == pytest.approx(g.max().item())
        assert s["mean"] == pytest.approx(g.mean().item()) and s["norm"] == pytest.approx(g.norm().item())
    net.print_gradient_stats()
    out = capsys.readouterr().out.splitlines()
    assert len(out) == 3 and out[0].startswith("Layer 0 (Dense): min=")


def test_errors():
    with pytest.raises(TypeError, match="layer 1 must be a torchloom layer or a torch.nn.Module, got function"):
        Network(Dense(2, 2), lambda x: x)
    with pytest.raises(ValueError, match="at least one layer"):
        Network()
    net = _net()
    with pytest.raises(RuntimeError, match="no recorded forward pass"):
        net.backward(torch.zeros(2, 3, dtype=torch.float64))
    net.forward_record(torch.randn(2, 4, dtype=torch.float64))
    with pytest.raises(ValueError, match=r"grad_output must have shape \[2, 3\], got \[2, 4\]"):
        net.backward(torch.zeros(2, 4, dtype=torch.float64))


def test_sequential_is_a_layer_with_hand_written_backward():
    seq = Sequential([Dense(3, 4, "silu", dtype=torch.float64), Dense(4, 2, "tanh", dtype=torch.float64)])
    x = torch.randn(5, 3, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda t: seq(t), (x,))
    y, saved = seq.forward_saved(x.detach())
    g = torch.randn_like(y)
    gx, grads = seq.backward_saved(g, saved)
    ref = torch.autograd.grad(seq(x), [x, *seq.parameters()], g)
    assert_close(gx, ref[0], name="grad_x", rtol=1e-12, atol=1e-12)
    assert len(grads) == 4
    for i, (a, r) in enumerate(zip(grads, ref[1:])):
        assert_close(a, r, name=f"param {i}", rtol=1e-12, atol=1e-12)


def test_state_dict_round_trip():
    a, b = _net(), _net()
    b.load_state_dict(a.state_dict())
    x = torch.randn(3, 4, dtype=torch.float64)
    assert torch.equal(a(x), b(x))


def test_a_layer_used_twice_gets_the_sum_of_its_gradients():
    shared = Dense(4, 4, "tanh", dtype=torch.float64)
    net = Network(shared, Dense(4, 4, "relu", dtype=torch.float64), shared, record_history=True)
    assert len(list(net.parameters())) == 4  # parameters() lists the shared layer once
    x = torch.randn(3, 4, dtype=torch.float64)
    g = torch.randn(3, 4, dtype=torch.float64)
    net.backward(g) if net(x) is not None else None
    got = [p.grad.clone() for p in net.parameters()]
    net.record_history = False
    ref = torch.autograd.grad(net(x), list(net.parameters()), g)
    for i, (a, r) in enumerate(zip(got, ref)):
        assert_close(a, r, name=f"param {i}", rtol=1e-12, atol=1e-12)
    _, saved = net.forward_saved(x)
    _, grads = net.backward_saved(g, saved)
    for i, (a, r) in enumerate(zip(grads, ref)):
        assert_close(a, r, name=f"backward_saved param {i}", rtol=1e-12, atol=1e-12)


@torch.no_grad()  # as the trainers call it
def test_sequential_routes_gradient_buffers_to_its_layers():
    net = _net()
    x = torch.randn(3, 4, dtype=torch.float64)
    y, saved = net.forward_saved(x)
    g = torch.randn_like(y)
    _, ref = net.backward_saved(g, saved)
    bufs = [torch.zeros_like(p) for p in net.parameters()]
    _, grads = net.backward_saved(g, saved, out=bufs)
    for i, (a, b, r) in enumerate(zip(grads, bufs, ref)):
        assert a is b, f"param {i} was not written in place"
        assert_close(a, r, name=f"param {i}", rtol=0, atol=0)
