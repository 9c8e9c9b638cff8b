"""``TrainingConfig(precision=...)``: mixed precision for every method through the engine, with
float32 master weights; float16 dynamic loss scaling (``LossScaler``) against GradScaler's rule."""

import copy

import numpy as np
import pytest
import torch
from sklearn.datasets import load_digits

from torchloom import Dense, Network, TargetPropConfig, TrainingConfig, TweenConfig, evaluate, train
from torchloom.methods.backprop import LossScaler


def _digits():
    d = load_digits()
    x = torch.tensor(d.data / 16.0, dtype=torch.float32)
    y = torch.tensor(d.target, dtype=torch.long)
    return (x[:1400], y[:1400]), (x[1400:], y[1400:])


@pytest.mark.parametrize(
    "method,kw",
    [("backprop", dict(loss_type="cross_entropy", optimizer="adamw", learning_rate=0.01)),
     (TweenConfig(base_rate=0.05), {}),
     (TargetPropConfig(learning_rate=0.064), {})],  # the step averaged over 32 rows: 0.002 summed
    ids=["backprop", "tween", "target_prop"],
)
def test_bf16_mixed_trains_digits_with_float32_master_weights(method, kw):
    (x, y), (xt, yt) = _digits()
    torch.manual_seed(0)
    net = Network(Dense(64, 32, "relu"), Dense(32, 10))
    ref = copy.deepcopy(net)
    cfg = dict(method=method, epochs=8, batch_size=32, verbose=0, metrics=("accuracy",), **kw)
    r16 = train(net, (x, y), TrainingConfig(precision="bf16-mixed", **cfg))
    r32 = train(ref, (x, y), TrainingConfig(**cfg))
    assert all(p.dtype == torch.float32 for p in net.parameters())
    acc16 = evaluate(net, (xt, yt), metrics=("accuracy",), loss_type="cross_entropy")["accuracy"]
    acc32 = evaluate(ref, (xt, yt), metrics=("accuracy",), loss_type="cross_entropy")["accuracy"]
    assert acc16 > 0.75 and acc16 > acc32 - 0.04
    # bf16 has an 8-bit mantissa: the curves agree to a few per cent, not to float32 rounding
    np.testing.assert_allclose(r16.loss_history, r32.loss_history, rtol=0.1)
    assert r16.loss_history != r32.loss_history  # autocast really ran


def test_16_mixed_backprop_trains_and_scales_the_loss():
    (x, y), (xt, yt) = _digits()
    torch.manual_seed(0)
    net = Network(Dense(64, 32, "relu"), Dense(32, 10))
    r = train(net, (x, y), TrainingConfig(precision="16-mixed", epochs=6, batch_size=32, verbose=0, loss_type="cross_entropy", learning_rate=0.1))
    assert r.loss_history[-1] < r.loss_history[0] * 0.5
    assert evaluate(net, (xt, yt), metrics=("accuracy",), loss_type="cross_entropy")["accuracy"] > 0.85


def test_loss_scaler_follows_gradscalers_rule():
    s = LossScaler(torch.device("cpu"), init=1024.0, interval=3)
    g = s.scale_grad(torch.ones(2))
    assert g.tolist() == [1024.0, 1024.0]
    grads = [torch.full((3,), 2048.0)]
    s.unscale_(grads)
    assert grads[0].tolist() == [2.0, 2.0, 2.0]
    s.update_(torch.tensor(True))  # overflow: halve, reset the count
    assert float(s.scale) == 512.0 and float(s.good) == 0.0
    for _ in range(3):  # three finite steps in a row: double
        s.update_(torch.tensor(False))
    assert float(s.scale) == 1024.0 and float(s.good) == 0.0


@pytest.mark.parametrize(
    "kw,match",
    [(dict(precision="fp16"), "precision must be one of"), (dict(precision="16-mixed", method="tween"), "for backprop")],
)
def test_bad_precision_settings(kw, match):
    with pytest.raises(ValueError, match=match):
        TrainingConfig(**kw)
