"""make_graphed_step: train()'s device-side step for custom loops (eager on CPU, a CUDA graph on GPU)."""

import copy

import numpy as np
import pytest
import torch

from helpers import assert_close
from torchloom import Dense, Network, make_graphed_step, train


def _net(dtype=torch.float64):
    torch.manual_seed(0)
    return Network(Dense(5, 12, "relu", dtype=dtype), Dense(12, 3, "sigmoid", dtype=dtype))


def _batches(n=6, bs=4, dtype=torch.float64):
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(bs, 5, generator=g, dtype=dtype), torch.rand(bs, 3, generator=g, dtype=dtype)) for _ in range(n)]


@pytest.mark.parametrize("optimizer,clip", [("sgd", 0.0), ("momentum", 0.05), ("adamw", 0.0)])
def test_custom_loop_equals_train(optimizer, clip):
    batches = _batches()
    a, b = _net(), _net()
    lr = 0.01 if optimizer == "adamw" else 0.2
    ref = train(a, batches, epochs=2, learning_rate=lr, optimizer=optimizer, gradient_clip=clip, verbose=False)
    step = make_graphed_step(b, *batches[0], optimizer=optimizer, learning_rate=lr, gradient_clip=clip)
    losses = []
    for _ in range(2):
        epoch = []
        for x, y in batches:
            epoch.append(step(x, y).item())
            assert step.last_status.item() == 0
        losses.append(sum(epoch) / len(epoch))
    np.testing.assert_allclose(losses, ref.loss_history, rtol=1e-6)  # per-step losses kept in float32
    for p, q in zip(b.parameters(), a.parameters()):
        assert_close(p, q, name="param", rtol=1e-12, atol=1e-12)


def test_a_nan_step_changes_nothing_and_the_next_one_trains():
    net = _net()
    batches = _batches(n=2)
    step = make_graphed_step(net, *batches[0])
    bad = batches[0][0].clone()
    bad[0, 0] = float("nan")
    before = copy.deepcopy(net)
    assert step(bad, batches[0][1]).item() == 0.0
    assert step.last_status.item() == 1
    for p, q in zip(net.parameters(), before.parameters()):
        assert torch.equal(p, q)
    assert step(*batches[1]).item() > 0 and step.last_status.item() == 0
    assert not all(torch.equal(p, q) for p, q in zip(net.parameters(), before.parameters()))


def test_bad_use_is_refused():
    net = _net()
    x, y = _batches(n=1)[0]
    step = make_graphed_step(net, x, y)
    with pytest.raises(ValueError, match=r"x must have the example's shape \[4, 5\], got \[3, 5\]"):
        step(x[:3], y[:3])
    with pytest.raises(TypeError, match="needs one of torchloom's optimizers"):
        make_graphed_step(net, x, y, optimizer=torch.optim.SGD(net.parameters(), lr=0.1))
    with pytest.raises(ValueError, match=r"target shape \[4, 2\] does not match output shape \[4, 3\]"):
        make_graphed_step(net, x, y[:, :2])
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="cuda_graph=True\\) needs a model on CUDA"):
            make_graphed_step(net, x, y, cuda_graph=True)


@pytest.mark.cuda
def test_graphed_step_on_cuda_captures_and_equals_cpu():
    batches = _batches(dtype=torch.float32)
    cpu_net, gpu_net = _net(torch.float32), _net(torch.float32).cuda()
    ref = train(cpu_net, batches, epochs=3, learning_rate=0.2, optimizer="momentum", verbose=False)
    step = make_graphed_step(gpu_net, *batches[0], optimizer="momentum", learning_rate=0.2)
    gpu_batches = [(x.cuda(), y.cuda()) for x, y in batches]
    losses = []
    for _ in range(3):
        total = torch.zeros((), device="cuda")
        for x, y in gpu_batches:
            total += step(x, y)
        losses.append(total.item() / len(gpu_batches))
    assert step.graph is not None
    np.testing.assert_allclose(losses, ref.loss_history, rtol=2e-5)
    for p, q in zip(gpu_net.parameters(), cpu_net.parameters()):
        assert_close(p.cpu(), q, name="param", rtol=2e-4, atol=2e-5)
    bad = gpu_batches[0][0].clone()
    bad[0, 0] = float("nan")
    before = [p.clone() for p in gpu_net.parameters()]
    step(bad, gpu_batches[0][1])
    assert step.last_status.item() == 1
    assert all(torch.equal(a, p) for a, p in zip(before, gpu_net.parameters()))
