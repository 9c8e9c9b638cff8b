"""Plain ``nn.Module``s inside a torchloom ``Network`` (``ModuleLayer``) and loss callables, trained by
``train()`` for every method; checked against a plain PyTorch loop with the same seed."""

import copy

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from helpers import assert_close
from torchloom import Dense, ModuleLayer, Network, TargetPropConfig, TrainingConfig, TweenConfig, train

F64 = torch.float64


def _layers():
    torch.manual_seed(0)
    return [
        Dense(8, 16, "relu", dtype=F64), nn.Dropout(0.3), nn.BatchNorm1d(16, dtype=F64), nn.Unflatten(1, (1, 16)),
        nn.MaxPool1d(2), nn.Flatten(), Dense(8, 3, dtype=F64),
    ]


def _data(n=5, bs=6):
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(bs, 8, generator=g, dtype=F64), torch.randint(0, 3, (bs,), generator=g)) for _ in range(n)]


def test_dropout_batchnorm_pool_network_equals_a_plain_pytorch_loop():
    data = _data()
    net = Network(*_layers())
    assert isinstance(net[1], ModuleLayer) and isinstance(net[2].module, nn.BatchNorm1d)
    train(net, data, TrainingConfig(epochs=3, learning_rate=0.1, loss_type="cross_entropy", verbose=0, seed=5))
    ref = nn.Sequential(*_layers())
    opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    torch.manual_seed(5)
    ref.train()
    for _ in range(3):
        for x, y in data:
            opt.zero_grad()
            F.cross_entropy(ref(x), y).backward()
            opt.step()
    mine, theirs = net.state_dict(), ref.state_dict()
    assert len(mine) == len(theirs)
    for (k, a), b in zip(mine.items(), theirs.values()):
        assert_close(a.double(), b.double(), name=k, rtol=1e-10, atol=1e-12)
    # BatchNorm saw exactly the 15 training steps: no hidden extra forward in train mode
    assert int(net[2].module.num_batches_tracked) == 15


def test_shape_probe_and_validation_leave_batchnorm_statistics_alone():
    net = Network(Dense(8, 16, dtype=F64), nn.BatchNorm1d(16, dtype=F64), Dense(16, 3, dtype=F64))
    train(net, _data(n=2), TrainingConfig(epochs=1, verbose=0, loss_type="cross_entropy", validation_data=_data(n=3)))
    assert int(net[1].module.num_batches_tracked) == 2
    assert net.training  # back in train mode after the run's validation


@pytest.mark.parametrize("method", [TargetPropConfig(learning_rate=0.01), TargetPropConfig(mode="pure", learning_rate=0.005), TweenConfig(base_rate=0.05)], ids=["tp", "tp-pure", "tween"])
def test_loom_methods_train_networks_with_plain_modules(method):
    torch.manual_seed(0)
    net = Network(Dense(8, 16, "tanh", dtype=F64), nn.LayerNorm(16, dtype=F64), nn.Linear(16, 3, dtype=F64))
    before = copy.deepcopy(net)
    data = _data(n=8)
    result = train(net, data, TrainingConfig(method=method, epochs=6, verbose=0))
    assert result.loss_history[-1] < result.loss_history[0]
    moved = [not torch.equal(a, b) for a, b in zip(net.parameters(), before.parameters())]
    if isinstance(method, TargetPropConfig) and method.mode == "pure":
        # pure mode has no derivative-free estimate through a plain module: the module's input target is
        # its input (Loom's fallback), so only the last module learns
        assert moved == [False, False, False, False, True, True]
    else:
        assert all(moved)  # the plain modules' parameters learn too


def test_loss_callable_equals_the_named_loss():
    data = _data()
    a, b = Network(Dense(8, 3, "tanh", dtype=F64)), None
    b = copy.deepcopy(a)
    ra = train(a, data, TrainingConfig(epochs=3, learning_rate=0.2, loss_type="cross_entropy", verbose=0))
    rb = train(b, data, TrainingConfig(epochs=3, learning_rate=0.2, loss_type=lambda out, y: F.cross_entropy(out, y), verbose=0))
    np.testing.assert_allclose(rb.loss_history, ra.loss_history, rtol=1e-12)
    for p, q in zip(a.parameters(), b.parameters()):
        assert_close(p, q, name="param", rtol=1e-10, atol=1e-13)


@pytest.mark.parametrize(
    "loss,exc,match",
    [
        (lambda out, y: out, TypeError, "must return a scalar tensor"),
        (lambda out, y: torch.tensor(1.0), TypeError, "does not depend on the output"),
    ],
)
def test_bad_loss_callables(loss, exc, match):
    net = Network(Dense(8, 3, dtype=F64))
    before = copy.deepcopy(net)
    with pytest.raises(exc, match=match):
        train(net, _data(), TrainingConfig(epochs=1, verbose=0, loss_type=loss))
    assert all(torch.equal(p, q) for p, q in zip(net.parameters(), before.parameters()))


def test_plain_models_are_accepted_and_modulelayer_rejects_non_modules():
    seq = nn.Sequential(nn.Linear(8, 4, dtype=F64), nn.Tanh(), nn.Linear(4, 3, dtype=F64))
    w = seq[0].weight.detach().clone()
    train(seq, _data(), TrainingConfig(epochs=1, verbose=0, loss_type="cross_entropy", learning_rate=0.1))
    assert not torch.equal(seq[0].weight, w)  # the user's own module was trained in place
    with pytest.raises(TypeError, match="must be a torch.nn.Module"):
        ModuleLayer(lambda x: x)
    with pytest.raises(TypeError, match="torchloom layer already"):
        ModuleLayer(Dense(2, 2))
    with pytest.raises(ValueError, match="cannot be used with TargetProp"):
        TrainingConfig(method="target_prop", loss_type="crossentropy")  # Loom's probability form: no target for the logits
