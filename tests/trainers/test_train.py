"""train() on CPU (SPEC §5) against an independent float64 torch autograd loop, plus guards and errors."""

import copy
import math
import re

import numpy as np
import pytest
import torch
import torchloom
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

from helpers import assert_close
from torchloom import Dense, Network, TrainingBatch, TrainingConfig, train


def _net(dtype=torch.float64, bias=True):
    return Network(Dense(3, 8, "tanh", bias=bias, dtype=dtype), Dense(8, 2, "sigmoid", bias=bias, dtype=dtype))


def _batches(n=4, bs=5, dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(bs, 3, generator=g, dtype=dtype), torch.rand(bs, 2, generator=g, dtype=dtype)) for _ in range(n)]


def _reference_sgd(net, batches, epochs, lr, clip=0.0, clip_mode="norm"):
    """The same training written as a plain torch autograd loop (the independent reference)."""
    net = copy.deepcopy(net)
    params = list(net.parameters())
    history = []
    for _ in range(epochs):
        total = 0.0
        for x, y in batches:
            l0, l1 = net
            out = torch.sigmoid(F.linear(torch.tanh(F.linear(x, l0.weight, l0.bias)), l1.weight, l1.bias))
            loss = F.mse_loss(out, y)
            grads = torch.autograd.grad(loss, params)
            if clip > 0 and clip_mode == "norm":
                norm = torch.sqrt(sum((g**2).sum() for g in grads))
                if norm > clip:
                    grads = [g * (clip / norm) for g in grads]
            elif clip > 0:
                grads = [g.clamp(-clip, clip) for g in grads]
            with torch.no_grad():
                for p, g in zip(params, grads):
                    p -= lr * g
            total += loss.item()
        history.append(total / len(batches))
    return net, history


@pytest.mark.parametrize("clip,mode", [(0.0, "norm"), (0.05, "norm"), (0.01, "value")])
def test_matches_autograd_sgd_loop_in_float64(clip, mode):
    net = _net()
    batches = _batches()
    ref_net, ref_hist = _reference_sgd(net, batches, epochs=6, lr=0.5, clip=clip, clip_mode=mode)
    result = train(net, batches, TrainingConfig(epochs=6, learning_rate=0.5, gradient_clip=clip, clip_mode=mode, verbose=False))
    np.testing.assert_allclose(result.loss_history, ref_hist, rtol=1e-12)
    for i, (p, r) in enumerate(zip(net.parameters(), ref_net.parameters())):
        assert_close(p, r, name=f"param {i}", rtol=1e-12, atol=1e-13)
    assert result.final_loss == result.loss_history[-1]
    assert len(result.epoch_times) == 6 and result.total_time >= sum(result.epoch_times) * 0.5
    assert result.samples_per_second > 0 and result.skipped_batches == 0
    assert result.history["loss"] == result.loss_history


def test_recorded_loss_is_the_pre_update_loss():
    net = _net()
    (x, y), = _batches(n=1)
    with torch.no_grad():
        before = F.mse_loss(net(x), y).item()
    result = train(net, [(x, y)], epochs=1, learning_rate=1.0, verbose=False)
    assert result.loss_history[0] == pytest.approx(before, rel=1e-14)


def test_accepts_batches_pairs_numpy_and_dataloader():
    batches = _batches(n=2, bs=4)
    nets = [_net() for _ in range(4)]
    for n in nets[1:]:
        n.load_state_dict(nets[0].state_dict())
    forms = [
        [TrainingBatch(x, y) for x, y in batches],
        [(x.numpy(), y.numpy()) for x, y in batches],
        [{"input": x, "target": y} for x, y in batches],
        DataLoader(TensorDataset(torch.cat([x for x, _ in batches]), torch.cat([y for _, y in batches])), batch_size=4),
    ]
    losses = [train(n, f, epochs=3, learning_rate=0.1, verbose=False).loss_history for n, f in zip(nets, forms)]
    for other in losses[1:]:
        np.testing.assert_allclose(other, losses[0], rtol=1e-12)


def test_float32_inputs_are_cast_to_the_model_dtype():
    net = _net(torch.float32)
    batches = [(x.double(), y.double()) for x, y in _batches(dtype=torch.float32)]
    result = train(net, batches, epochs=2, verbose=False)
    assert np.isfinite(result.final_loss) and net[0].weight.dtype == torch.float32


def test_ragged_last_batch_and_cross_entropy_labels():
    torch.manual_seed(3)
    net = Network(Dense(4, 16, "relu"), Dense(16, 3))
    x = torch.randn(50, 4)
    y = (x[:, 0] > 0).long() + (x[:, 1] > 0).long()
    batches = [(x[i : i + 16], y[i : i + 16]) for i in range(0, 50, 16)]  # 16, 16, 16, 2
    result = train(net, batches, epochs=60, learning_rate=0.5, loss_type="cross_entropy", verbose=False)
    assert result.loss_history[-1] < 0.5 * result.loss_history[0]
    acc = (net(x).argmax(1) == y).float().mean().item()
    assert acc > 0.85


def test_seed_makes_shuffled_training_reproducible():
    data = TensorDataset(torch.randn(40, 3, dtype=torch.float64), torch.rand(40, 2, dtype=torch.float64))
    runs = []
    for _ in range(2):
        torch.manual_seed(0)
        net = _net()
        torch.manual_seed(123)  # perturb the global RNG: the seed setting must restore determinism
        runs.append(train(net, DataLoader(data, batch_size=8, shuffle=True), epochs=3, seed=7, verbose=False).loss_history)
    assert runs[0] == runs[1]


def test_verbose_epoch_line_format(capsys):
    train(_net(), _batches(), epochs=2, verbose=2)  # verbose 2: Loom's exact epoch line
    lines = capsys.readouterr().out.strip().splitlines()
    pattern = r"Epoch (\d+)/2 - Loss: \d+\.\d{6} \| Time: [0-9.]+(ns|µs|ms|s) \| Samples/s: \d+\.\d{2} \| ETA: \d+s"
    assert len(lines) == 2
    for i, line in enumerate(lines):
        m = re.fullmatch(pattern, line)
        assert m, line
        assert m.group(1) == str(i + 1)


def test_nan_loss_abandons_the_epoch_and_keeps_weights(capsys):
    net = _net()
    good = _batches(n=3)
    bad_x = good[1][0].clone()
    bad_x[0, 0] = float("nan")
    batches = [good[0], (bad_x, good[1][1]), good[2]]
    snapshot = copy.deepcopy(net)
    ref_net, _ = _reference_sgd(snapshot, [good[0]], epochs=1, lr=0.1)  # only batch 0 is applied
    result = train(net, batches, epochs=1, learning_rate=0.1, verbose=True)
    out = capsys.readouterr().out
    assert "⚠️ Fatal NaN/Inf loss in epoch 1. Skipping epoch." in out
    for p, r in zip(net.parameters(), ref_net.parameters()):
        assert torch.isfinite(p).all()
        assert_close(p, r, name="weights", rtol=1e-12, atol=1e-13)
    assert result.skipped_batches == 2  # the NaN batch and the one after it
    # Loom divides by all batches of the epoch
    with torch.no_grad():
        l0 = F.mse_loss(snapshot(good[0][0]), good[0][1]).item()
    assert result.loss_history[0] == pytest.approx(l0 / 3, rel=1e-12)


def test_nan_gradients_skip_the_update(capsys):
    net = Network(Dense(1, 1, bias=False))
    with torch.no_grad():
        net[0].weight.zero_()
    x = torch.tensor([[3e38]])  # 0·x = 0 keeps the loss finite, dW = −2·3e38 overflows to −inf
    with pytest.warns(torchloom.DivergenceWarning, match="no batch counted"):
        result = train(net, [(x, torch.tensor([[1.0]]))], epochs=2, learning_rate=0.1, verbose=True)
    out = capsys.readouterr().out
    assert out.count("⚠️ Fatal NaN/Inf gradients in epoch") == 2
    assert "epoch 1. Skipping batch updates." in out and "epoch 2." in out
    assert net[0].weight.item() == 0.0
    # no batch counted: the epochs read NaN (never a perfect 0.0), every skip counted per epoch
    assert result.skipped_batches == 2 and result.skipped_per_epoch == [1, 1]
    assert all(math.isnan(v) for v in result.loss_history)


def test_optimizer_instance_and_schedule():
    net = _net()
    ref = copy.deepcopy(net)
    batches = _batches(n=3)
    opt = torch.optim.SGD(net.parameters(), lr=0.3)
    train(net, batches, epochs=2, optimizer=opt, verbose=False)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.3)
    for _ in range(2):
        for x, y in batches:
            ref_opt.zero_grad()
            F.mse_loss(ref(x), y).backward()
            ref_opt.step()
    for p, r in zip(net.parameters(), ref.parameters()):
        assert_close(p, r, name="w", rtol=1e-12, atol=1e-13)

    seen = []
    net2 = _net()
    train(net2, batches, epochs=2, scheduler=lambda step: seen.append(step) or 0.1 / (1 + step), verbose=False)
    assert seen[:7] == list(range(7))  # one scheduler step per batch, 0-based


def _weights(net):
    return [p.detach().clone() for p in net.parameters()]


@pytest.mark.parametrize(
    "batches,kwargs,exc,match",
    [
        ([], {}, ValueError, "batches is empty"),
        (None, dict(epochs=0), ValueError, "epochs must be an int >= 1, got 0"),
        (None, dict(learning_rate=0.0), ValueError, "learning_rate must be a finite number > 0 or None .*, got 0.0"),
        (None, dict(learning_rate=-1), ValueError, "learning_rate must be a finite number > 0 or None .*, got -1"),
        (None, dict(loss_type="l1"), ValueError, "unknown loss_type 'l1'"),
        (None, dict(optimizer="lion"), ValueError, "unknown optimizer 'lion'"),
        (None, dict(clip_mode="global"), ValueError, "clip_mode must be one of"),
        (None, dict(gradient_clip=-1.0), ValueError, "gradient_clip must be a finite number >= 0"),
        (None, dict(verbose=3), ValueError, "verbose must be a bool or 0, 1, 2"),
        (None, dict(bogus=1), TypeError, r"train\(\): unknown setting 'bogus'; valid fields: epochs, "),
        ("shape", {}, ValueError, r"batch 2: target shape \[5, 3\] does not match output shape \[5, 2\]"),
        ("input", {}, ValueError, r"batch 1: Dense\(3→8\): input must have shape \[batch, \.\.\., 3\], got \[5, 4\]"),
        ("batch", {}, ValueError, r"batch 0: target must have the input's batch size 5"),
        ("labels", dict(loss_type="cross_entropy"), ValueError, r"batch 0: class labels must lie in \[0, 2\)"),
    ],
)
def test_bad_input_raises_before_any_weight_changes(batches, kwargs, exc, match):
    net = _net()
    before = _weights(net)
    good = _batches()
    if batches is None:
        batches = good
    elif batches == "shape":
        batches = good[:2] + [(good[2][0], torch.rand(5, 3, dtype=torch.float64))]
    elif batches == "input":
        batches = good[:1] + [(torch.randn(5, 4, dtype=torch.float64), good[1][1])]
    elif batches == "batch":
        batches = [(good[0][0], good[0][1][:4])]
    elif batches == "labels":
        batches = [(good[0][0], torch.tensor([0, 1, 2, 0, 1]))]
    with pytest.raises(exc, match=match):
        train(net, batches, **{"verbose": False, **kwargs})
    assert all(torch.equal(a, b) for a, b in zip(before, _weights(net)))


def test_unknown_activation_name_is_a_value_error():
    with pytest.raises(ValueError, match="unknown activation 'rleu'"):
        Network(Dense(2, 2, "rleu"))


def test_model_type_errors():
    with pytest.raises(TypeError, match="model must be a torchloom Network, a torchloom layer, an nn.Module"):
        train("not a model", _batches(), verbose=False)
    with pytest.raises(TypeError, match="batches must be a list"):
        train(_net(), torch.zeros(3), verbose=False)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU error")
def test_gpu_request_without_cuda_is_a_clear_runtime_error():
    net = _net()
    with pytest.raises(RuntimeError, match="CUDA is not available"):
        train(net, _batches(), use_gpu=True, verbose=False)
    assert net[0].weight.device.type == "cpu"


def test_a_layer_or_list_of_layers_is_wrapped():
    layer = Dense(3, 2, "sigmoid", dtype=torch.float64)
    w0 = layer.weight.detach().clone()
    train(layer, _batches(), epochs=1, verbose=False)
    assert not torch.equal(w0, layer.weight)
    layers = [Dense(3, 4, dtype=torch.float64), Dense(4, 2, dtype=torch.float64)]
    train(layers, _batches(), epochs=1, verbose=False)


@pytest.mark.parametrize("method", ["backprop", "tween"])
def test_divergence_warning_names_the_users_call(method):
    """The warning points at the caller's line (the first frame outside torchloom), not the engine's."""
    net = Network(Dense(2, 2))
    bad = [(torch.full((3, 2), float("nan")), torch.rand(3, 2))]
    with pytest.warns(torchloom.DivergenceWarning) as record:
        train(net, bad, epochs=1, loss_type="mse", method=method, verbose=0)
    assert {w.filename for w in record if issubclass(w.category, torchloom.DivergenceWarning)} == {__file__}
