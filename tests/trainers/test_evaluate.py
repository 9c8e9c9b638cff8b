"""evaluate() and predict(): losses and metrics against independent torch/NumPy computations on the
whole data, every data form, eval mode and no grad with modes restored, any nn.Module, bad input."""

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import torchloom
from torchloom import Dense, Network, evaluate, predict
from torchloom.engine.metrics import MetricSet


def _linear(i=3, o=2, dtype=torch.float32):
    torch.manual_seed(1)
    return nn.Linear(i, o).to(dtype)


# ------------------------------------------------------------------------------------ losses
def test_mse_and_metrics_match_a_whole_data_computation():
    model = _linear()
    X, Y = torch.randn(23, 3), torch.randn(23, 2)
    got = evaluate(model, (X, Y), metrics=["mae", "rmse"], batch_size=5)
    with torch.no_grad():
        o = model(X).double().numpy()
    y = Y.double().numpy()
    assert got.keys() == {"loss", "mae", "rmse"}
    assert got["loss"] == pytest.approx(np.mean((o - y) ** 2), rel=1e-6)
    assert got["mae"] == pytest.approx(np.mean(np.abs(o - y)), rel=1e-6)
    assert got["rmse"] == pytest.approx(np.sqrt(np.mean((o - y) ** 2)), rel=1e-6)


def test_loss_is_the_sample_weighted_mean_over_uneven_batches():
    model = _linear()
    X, Y = torch.randn(10, 3), torch.randn(10, 2)
    batches = [(X[:1], Y[:1]), (X[1:10], Y[1:10])]
    with torch.no_grad():
        per = [F.mse_loss(model(x).double(), y.double()).item() for x, y in batches]
    ref = (1 * per[0] + 9 * per[1]) / 10  # not the plain mean of the two batch losses
    assert evaluate(model, batches)["loss"] == pytest.approx(ref, rel=1e-6)
    assert abs(ref - np.mean(per)) > 1e-3


def test_crossentropy_loom_form_on_probabilities():
    model = nn.Sequential(nn.Linear(4, 3), nn.Softmax(-1))
    X = torch.randn(12, 4)
    Y = F.one_hot(torch.randint(0, 3, (12,)), 3).float()
    with torch.no_grad():
        p = model(X).double().numpy()
    ref = np.mean(-Y.double().numpy() * np.log(p + 1e-10))
    assert evaluate(model, (X, Y), loss_type="crossentropy", batch_size=5)["loss"] == pytest.approx(ref, rel=1e-6)


def test_callable_loss():
    model = _linear()
    X, Y = torch.randn(11, 3), torch.randn(11, 2)
    got = evaluate(model, (X, Y), loss_type=nn.L1Loss(), batch_size=4)
    with torch.no_grad():
        ref = np.mean(np.abs(model(X).double().numpy() - Y.double().numpy()))
    assert got["loss"] == pytest.approx(ref, rel=1e-6)

    def huber_as_float(output, target):  # a number is accepted too
        return float(F.huber_loss(output, target))

    got = evaluate(model, (X, Y), loss_type=huber_as_float, batch_size=11)
    with torch.no_grad():
        assert got["loss"] == pytest.approx(F.huber_loss(model(X), Y).item(), rel=1e-6)


# --------------------------------------------------------------------- a realistic digits test
def test_digits_network_cross_entropy_and_accuracy():
    from sklearn.datasets import load_digits

    d = load_digits()
    X = torch.tensor(d.data / 16.0, dtype=torch.float32)
    y = torch.tensor(d.target, dtype=torch.long)
    torch.manual_seed(0)
    net = Network(Dense(64, 32, "relu"), Dense(32, 10))
    opt = torch.optim.Adam(net.parameters(), lr=0.02)
    for _ in range(40):  # a short full-batch training so the numbers are not trivial
        opt.zero_grad()
        F.cross_entropy(net(X), y).backward()
        opt.step()

    got = evaluate(net, (X, y), loss_type="cross_entropy", metrics=["accuracy"], batch_size=100)
    with torch.no_grad():
        logits = net(X)
    ref_loss = F.cross_entropy(logits.double(), y).item()
    ref_acc = float(np.mean(np.argmax(logits.numpy(), 1) == d.target))
    assert got["loss"] == pytest.approx(ref_loss, rel=1e-5)
    assert got["accuracy"] == pytest.approx(ref_acc, abs=1e-12)
    assert ref_acc > 0.8  # it learned something: accuracy is not a trivial 0.1

    # the same numbers from every data form, and with one-hot targets
    one_hot = F.one_hot(y, 10).float()
    ds = TensorDataset(X, y)
    forms = [
        dict(data=(X, one_hot), batch_size=64),
        dict(data=ds, batch_size=500),
        dict(data=DataLoader(ds, batch_size=77)),
        dict(data=[(X[:900], y[:900]), (X[900:], y[900:])]),
    ]
    for form in forms:
        g = evaluate(net, form.pop("data"), loss_type="cross_entropy", metrics=["accuracy"], **form)
        assert g["loss"] == pytest.approx(ref_loss, rel=1e-5) and g["accuracy"] == pytest.approx(ref_acc, abs=1e-12)

    probs = predict(net, X, batch_size=256)
    torch.testing.assert_close(probs, logits, rtol=0, atol=0)


# ------------------------------------------------------------ eval mode, no grad, restored state
class _Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 6)
        self.bn = nn.BatchNorm1d(6)
        self.drop = nn.Dropout(0.5)
        self.out = nn.Linear(6, 2)

    def forward(self, x):
        return self.out(self.drop(self.bn(self.lin(x))))


def test_eval_mode_no_grad_and_modes_restored():
    torch.manual_seed(3)
    model = _Block()
    X, Y = torch.randn(16, 4), torch.randn(16, 2)
    model(X)  # give BatchNorm non-trivial running statistics
    model.train()
    model.drop.eval()  # a mixed state must come back exactly
    modes = {n: m.training for n, m in model.named_modules()}
    stats = (model.bn.running_mean.clone(), model.bn.running_var.clone(), model.bn.num_batches_tracked.clone())

    got = evaluate(model, (X, Y), batch_size=5, metrics=["mae"])
    out = predict(model, X, batch_size=5)

    assert {n: m.training for n, m in model.named_modules()} == modes
    assert torch.equal(model.bn.running_mean, stats[0]) and torch.equal(model.bn.running_var, stats[1])
    assert torch.equal(model.bn.num_batches_tracked, stats[2])  # no train-mode forward happened
    assert all(p.grad is None for p in model.parameters()) and not out.requires_grad
    ref_model = _Block()
    ref_model.load_state_dict(model.state_dict())
    ref_model.eval()
    with torch.no_grad():
        ref = ref_model(X)  # eval mode: running statistics, no dropout
    torch.testing.assert_close(out, ref)
    assert got["loss"] == pytest.approx(F.mse_loss(ref.double(), Y.double()).item(), rel=1e-6)


def test_modes_are_restored_after_an_error():
    model = _Block().train()
    with pytest.raises(ValueError, match="batch 0"):
        evaluate(model, (torch.randn(4, 4), torch.randn(4, 3)))  # target shape does not fit the output
    assert all(m.training for m in model.modules())
    assert torch.is_grad_enabled()


def test_loom_mode_network_keeps_its_history():
    net = Network(Dense(3, 4, "tanh"), Dense(4, 1), record_history=True)
    x = torch.randn(5, 3)
    net(x)
    history = net.history
    evaluate(net, (torch.randn(7, 3), torch.randn(7, 1)))
    predict(net, torch.randn(7, 3))
    assert net.history is history


def test_predict_forms_order_dtype_and_device():
    model = _linear(dtype=torch.float64)
    X = torch.randn(13, 3)  # float32 inputs are cast to the model's float64
    with torch.no_grad():
        ref = model(X.double())
    for data, bs in ((X, 4), ((X, torch.zeros(13)), 5), ([X[:6], X[6:]], None),
                     (DataLoader(TensorDataset(X, torch.zeros(13)), batch_size=3), None), (TensorDataset(X), 6)):
        out = predict(model, data, batch_size=bs)
        assert out.dtype == torch.float64 and out.device.type == "cpu"
        torch.testing.assert_close(out, ref, rtol=0, atol=0)
    out = predict(model, X, device="cpu")
    assert out.device == torch.device("cpu")


def test_integer_inputs_and_a_parameterless_model():
    emb = nn.Embedding(10, 3)
    idx = torch.randint(0, 10, (9, 2))
    with torch.no_grad():
        torch.testing.assert_close(predict(emb, idx, batch_size=4), emb(idx))
    relu = nn.ReLU()
    x = torch.randn(5, 2)
    assert torch.equal(predict(relu, x), relu(x))
    assert evaluate(relu, (x, relu(x)))["loss"] == 0.0


def test_metric_set_object_and_torchloom_exports():
    model = _linear()
    X, y = torch.randn(10, 3), torch.randint(0, 2, (10,))
    ms = MetricSet(["accuracy"])
    ms.update(torch.randn(3, 2), torch.zeros(3, dtype=torch.long))  # stale state is reset first
    got = evaluate(model, (X, y), loss_type="cross_entropy", metrics=ms)
    with torch.no_grad():
        ref = float(np.mean(np.argmax(model(X).numpy(), 1) == y.numpy()))
    assert got["accuracy"] == pytest.approx(ref, abs=1e-12)
    assert torchloom.evaluate is evaluate and torchloom.predict is predict and torchloom.MetricSet is MetricSet
    assert {"evaluate", "predict", "MetricSet"} <= set(torchloom.__all__)


# ------------------------------------------------------------------------------------ bad input
def test_bad_arguments_are_rejected_before_the_model_runs():
    calls = []

    class Spy(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(3, 2)

        def forward(self, x):
            calls.append(1)
            return self.lin(x)

    model = Spy()
    X, Y = torch.randn(4, 3), torch.randn(4, 2)
    cases = [
        (dict(loss_type="MSE"), ValueError, r"unknown loss_type 'MSE'.*did you mean 'mse'"),
        (dict(loss_type=3), TypeError, "loss_type must be one of 'mse'"),
        (dict(loss_type=nn.MSELoss), TypeError, "loss_type must be one of"),
        (dict(metrics=["acc"]), ValueError, "unknown metric name 'acc'"),
        (dict(metrics={"loss": "mse"}), ValueError, "'loss' is reserved"),
        (dict(batch_size=0), ValueError, "batch_size must be >= 1"),
        (dict(device=3), TypeError, "device must be a str"),
        (dict(device="gpu7"), ValueError, "device 'gpu7' is not a valid torch device"),
    ]
    for kwargs, exc, match in cases:
        with pytest.raises(exc, match=match):
            evaluate(model, (X, Y), **kwargs)
    with pytest.raises(ValueError, match="data is empty"):
        evaluate(model, [])
    with pytest.raises(ValueError, match="batch_size=2 does not apply to a list"):
        evaluate(model, [(X, Y)], batch_size=2)
    with pytest.raises(TypeError, match="model must be a torch.nn.Module"):
        evaluate(lambda x: x, (X, Y))
    with pytest.raises(TypeError, match="model must be a torch.nn.Module"):
        predict("net", X)
    with pytest.raises(ValueError, match="data: inputs must be"):
        predict(model, torch.randn(0, 3))
    assert calls == []


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU error")
def test_cuda_device_without_cuda_is_a_runtime_error():
    with pytest.raises(RuntimeError, match="CUDA is not available"):
        evaluate(_linear(), (torch.randn(2, 3), torch.randn(2, 2)), device="cuda")
    with pytest.raises(RuntimeError, match="CUDA is not available"):
        predict(_linear(), torch.randn(2, 3), device="cuda")


def test_bad_batches_name_the_batch():
    model = _linear()
    X = torch.randn(6, 3)
    with pytest.raises(ValueError, match="batch 0: integer class labels are only accepted by loss_type='cross_entropy'"):
        evaluate(model, (X, torch.zeros(6, dtype=torch.long)))
    with pytest.raises(ValueError, match=r"batch 1: class labels must lie in \[0, 2\)"):
        evaluate(model, [(X[:3], torch.zeros(3, dtype=torch.long)), (X[3:], torch.full((3,), 5))], loss_type="cross_entropy")
    with pytest.raises(ValueError, match=r"loss_type 'per_row' returned a tensor of shape \[6, 2\]"):

        def per_row(o, t):
            return (o - t) ** 2

        evaluate(model, (X, torch.randn(6, 2)), loss_type=per_row)
    with pytest.raises(TypeError, match="returned str"):
        evaluate(model, (X, torch.randn(6, 2)), loss_type=lambda o, t: "x")

    class TupleOut(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(3, 2)

        def forward(self, x):
            return self.lin(x), x

    with pytest.raises(TypeError, match="the model returned tuple"):
        predict(TupleOut(), X)

    class Ragged(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.ones(1))

        def forward(self, x):
            return x[:, : x.shape[0]] * self.w  # trailing size depends on the batch

    with pytest.raises(ValueError, match="does not stack with batch 0"):
        predict(Ragged(), torch.randn(5, 4), batch_size=3)
