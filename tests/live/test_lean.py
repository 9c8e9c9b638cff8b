"""The lean host step (torchloom/live/lean.py): the same weights and statuses as backprop's own step
with the engine's guard (LiveConfig(lean=False)) and as autograd SGD in float64; where it does not
apply, the live loop uses the method's step."""

from __future__ import annotations

import pytest
import torch

import torchloom.methods  # noqa: F401  (registers every method)
from torchloom import Dense, Network
from torchloom.live import LiveTrainer
from torchloom.methods.backprop import Backprop

from ..helpers import assert_close, op_names


def net_of(acts=("tanh", "relu", "sigmoid", "linear"), widths=(6, 10, 9, 7, 4), seed=0, bias=True) -> Network:
    torch.manual_seed(seed)
    return Network(*[Dense(widths[i], widths[i + 1], activation=a, bias=bias) for i, a in enumerate(acts)])


def samples(n: int, seed: int = 1, dim: int = 6, classes: int = 4):
    g = torch.Generator().manual_seed(seed)
    x = torch.rand(n, dim, generator=g) * 2 - 1
    return x, torch.randint(0, classes, (n,), generator=g)


def autograd_sgd(net: Network, x: torch.Tensor, label: torch.Tensor, lr: float) -> list[torch.Tensor]:
    """One SGD step on mean((out − onehot)²) by torch autograd in float64, from ``net``'s weights."""
    params = [p.detach().double().clone().requires_grad_(True) for p in net.parameters()]
    h, k = x.double(), 0
    for layer in net.layers:
        w = params[k]
        b = params[k + 1] if layer.bias is not None else None
        k += 2 if b is not None else 1
        h = h @ w.T + (b if b is not None else 0)
        h = {"tanh": torch.tanh, "relu": torch.relu, "sigmoid": torch.sigmoid, "linear": lambda t: t}[layer.activation.name](h)
    target = torch.nn.functional.one_hot(label, h.shape[1]).double()
    ((h - target) ** 2).mean().backward()
    return [(p - lr * p.grad).detach() for p in params]


def run(live: LiveTrainer, x, y) -> list[torch.Tensor]:
    preds = []
    for i in range(len(y)):
        p, t = live.serve(x[i])
        preds.append(p.clone())
        live.learn(t, int(y[i]))
    return preds


@pytest.mark.parametrize("bias", [True, False])
def test_lean_step_equals_the_methods_step_and_autograd(bias):
    x, y = samples(20)
    lean = LiveTrainer(net_of(bias=bias), method="backprop", learning_rate=0.1)
    method = LiveTrainer(net_of(bias=bias), method="backprop", learning_rate=0.1, lean=False)
    assert lean._lean is not None and method._lean is None
    reference = net_of(bias=bias)
    for i in range(20):
        p_lean, t = lean.serve(x[i])
        p_method, u = method.serve(x[i])
        assert_close(p_lean, p_method, name=f"prediction {i}", rtol=1e-6, atol=1e-7)
        want = autograd_sgd(reference, x[i : i + 1], y[i : i + 1], 0.1)
        with torch.no_grad():
            for p, w in zip(reference.parameters(), want):
                p.copy_(w)
        lean.learn(t, int(y[i]))
        method.learn(u, int(y[i]))
        for a, b, c in zip(lean.model.parameters(), method.model.parameters(), want):
            assert_close(a, b, name=f"lean vs method, step {i}", rtol=1e-5, atol=1e-6)
            assert_close(a, c, name=f"lean vs autograd, step {i}", rtol=1e-4, atol=1e-5)
    assert lean.version == method.version == 20 and lean.statuses == method.statuses


def test_lean_batches_equal_the_methods_batches():
    """The batch schedule: the lean step runs its own forward over the k samples (the bias gradient
    summed over them) and matches the method's step."""
    x, y = samples(12, seed=3)
    lean = LiveTrainer(net_of(), method="backprop", schedule="batch", batch_size=4)
    method = LiveTrainer(net_of(), method="backprop", schedule="batch", batch_size=4, lean=False)
    run(lean, x, y)
    run(method, x, y)
    assert lean.version == method.version == 3
    for a, b in zip(lean.model.parameters(), method.model.parameters()):
        assert_close(a, b, name="batch weights", rtol=1e-5, atol=1e-6)


def _one_step(lean: bool, net: Network, x: torch.Tensor, label: int, lr: float = 0.05):
    live = LiveTrainer(net, method="backprop", learning_rate=lr, lean=lean)
    before = [p.detach().clone() for p in live.model.parameters()]
    _, t = live.serve(x)
    live.learn(t, label)
    changed = any(not torch.equal(a, b) for a, b in zip(before, live.model.parameters()))
    return {k: v for k, v in live.statuses.items() if v}, changed, live


def test_statuses_and_untouched_weights_match_the_method_when_something_overflows():
    linear = ("linear", "linear"), (6, 5, 4)
    cases = {
        "NAN_LOSS": ((), torch.full((6,), float("nan")), 0.05),
        # linear layers on a huge input: the loss (float64) is finite, the weight gradient overflows
        "NAN_GRAD": (linear, torch.full((6,), 3e36), 0.05),
        # finite gradients, a rate that throws the weights past float32's range
        "NAN_WEIGHTS": (linear, torch.full((6,), 100.0), 1e38),
    }
    for status, (shape, x, lr) in cases.items():
        got = _one_step(True, net_of(*shape), x, 1, lr)
        want = _one_step(False, net_of(*shape), x, 1, lr)
        assert got[0] == want[0] == {status: 1}, (status, got[0], want[0])
        assert not got[1] and not want[1], f"{status}: the weights changed"
        assert got[2].version == 0


def test_an_overflowing_sum_of_finite_weights_is_still_an_update():
    """The one host read is the new weights' sum; when only the sum overflows (every weight finite) the
    update still counts, as in the method's step."""
    def huge() -> Network:
        net = net_of(("linear", "linear"), (6, 40, 4))
        with torch.no_grad():
            net.layers[0].weight.fill_(3e37)  # 240 of them: the sum overflows float32
        return net

    x = torch.zeros(6)  # the huge weights meet a zero input: a finite forward and gradient
    got, changed, live = _one_step(True, huge(), x, 2)
    want, _, ref = _one_step(False, huge(), x, 2)
    assert got == want == {"OK": 1} and changed
    for a, b in zip(live.model.parameters(), ref.model.parameters()):
        assert torch.equal(a, b)


def test_where_the_lean_step_does_not_apply_the_methods_step_runs():
    assert LiveTrainer(net_of(), method="backprop", loss_type="cross_entropy")._lean is None
    class SignSymmetry(Backprop):  # a rule of its own on backprop's machinery: not backprop's step
        def backward(self, grad_out, saved):
            return super().backward(grad_out, saved)

    assert LiveTrainer(net_of(), method=SignSymmetry())._lean is None
    assert LiveTrainer(net_of(), method="tween")._lean is None
    assert LiveTrainer(net_of(), method="backprop", optimizer="adamw")._lean is None
    # momentum switched on mid-stream: the next steps are the method's (momentum state and all)
    x, y = samples(10, seed=5)
    lean = LiveTrainer(net_of(), method="backprop")
    method = LiveTrainer(net_of(), method="backprop", lean=False)
    run(lean, x[:5], y[:5])
    run(method, x[:5], y[:5])
    for live in (lean, method):
        live.method.optimizer.param_groups[0]["momentum"] = 0.9
    assert not lean._lean.ready()
    run(lean, x[5:], y[5:])
    run(method, x[5:], y[5:])
    assert lean.method.optimizer.state  # the momentum buffers exist: the method's step ran
    for a, b in zip(lean.model.parameters(), method.model.parameters()):
        assert_close(a, b, name="weights after momentum came on", rtol=1e-5, atol=1e-6)


def test_a_sample_costs_the_lean_op_budget():
    """adaptv2's net (Dense 8→32→64→64→64→32→4): a serve is its 6 addmm + 5 tanh; a learn (score,
    target, update) at most 30 torch ops with one host read (the new weights' sum), where the method's
    step with the engine's guard makes ~95 with three."""
    widths = [8, 32, 64, 64, 64, 32, 4]
    net_ = net_of(["tanh"] * 5 + ["linear"], widths)
    live = LiveTrainer(net_, method="backprop")
    x, y = samples(4, dim=8)
    labels = y.tolist()
    for i in range(3):
        _, t = live.serve(x[i])
        live.learn(t, labels[i])
    with op_names() as serve_ops:
        _, t = live.serve(x[3])
    with op_names() as learn_ops:
        live.learn(t, labels[3])
    assert serve_ops.names.count("addmm") == 6 and serve_ops.names.count("tanh") == 5 and len(serve_ops.names) <= 13  # + the input as [1, 8]
    assert learn_ops.names.count("_local_scalar_dense") == 1 and len(learn_ops.names) <= 30, learn_ops.names
    assert live.version == 4


def test_an_optimizer_step_hook_takes_the_methods_step():
    """A step hook (the optimizer's own, or a global one) is honoured: the lean step stands aside."""
    from torch.optim.optimizer import register_optimizer_step_pre_hook

    x, y = samples(2)
    live = LiveTrainer(net_of(), method="backprop")
    calls = []
    handle = register_optimizer_step_pre_hook(lambda opt, args, kwargs: calls.append(1))
    try:
        assert not live._lean.ready()
        _, t = live.serve(x[0])
        live.learn(t, int(y[0]))
    finally:
        handle.remove()
    assert calls == [1] and live._lean.ready()
    own = live.method.optimizer.register_step_post_hook(lambda opt, args, kwargs: calls.append(2))
    _, t = live.serve(x[1])
    live.learn(t, int(y[1]))
    own.remove()
    assert calls == [1, 2] and live.version == 2
