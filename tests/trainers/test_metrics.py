"""MetricSet: every named metric against a NumPy hand computation, callables, the update/compute/reset
protocol (a stub, and torchmetrics when installed), no host sync in update, bad input."""

import math

import numpy as np
import pytest
import torch

from torchloom.engine.metrics import METRIC_NAMES, MetricSet


def _batches(outputs, targets, sizes):
    """Cut whole outputs/targets into batches of ``sizes`` rows."""
    out, start = [], 0
    for s in sizes:
        out.append((outputs[start : start + s], targets[start : start + s]))
        start += s
    return out


def _run(metrics, batches, **kw):
    ms = MetricSet(metrics, **kw)
    for o, t in batches:
        ms.update(o, t)
    return ms.compute()


SIZES = (7, 3, 11, 1)  # 22 rows in uneven batches


# --------------------------------------------------------------------------- named, vs NumPy
def test_regression_metrics_match_numpy():
    o = torch.randn(22, 3, dtype=torch.float32)
    y = torch.randn(22, 3, dtype=torch.float32)
    got = _run(["mse", "mae", "rmse"], _batches(o, y, SIZES))
    on, yn = o.numpy().astype(np.float64), y.numpy().astype(np.float64)
    assert got["mse"] == pytest.approx(np.mean((on - yn) ** 2), rel=1e-12)
    assert got["mae"] == pytest.approx(np.mean(np.abs(on - yn)), rel=1e-12)
    assert got["rmse"] == pytest.approx(np.sqrt(np.mean((on - yn) ** 2)), rel=1e-12)
    assert list(got) == ["mse", "mae", "rmse"] and all(type(v) is float for v in got.values())


def test_regression_metrics_accept_b_against_b1():
    o = torch.randn(9, 1)
    y = torch.randn(9)
    got = _run(["mae"], [(o, y)])
    assert got["mae"] == pytest.approx(np.mean(np.abs(o.numpy()[:, 0].astype(np.float64) - y.numpy())), rel=1e-6)
    got = _run(["mse"], [(o[:, 0], y[:, None])])
    assert got["mse"] == pytest.approx(np.mean((o.numpy()[:, 0].astype(np.float64) - y.numpy()) ** 2), rel=1e-6)


def test_accuracy_with_labels_one_hot_and_soft_targets_matches_numpy():
    o = torch.randn(22, 5)
    labels = torch.randint(0, 5, (22,))
    labels[:6] = o[:6].argmax(-1)  # some certainly right
    ref = float(np.mean(np.argmax(o.numpy(), axis=1) == labels.numpy()))
    assert _run(["accuracy"], _batches(o, labels, SIZES))["accuracy"] == pytest.approx(ref, abs=1e-15)
    one_hot = np.eye(5, dtype=np.float32)[labels.numpy()]
    assert _run(["accuracy"], _batches(o, torch.from_numpy(one_hot), SIZES))["accuracy"] == pytest.approx(ref, abs=1e-15)
    soft = torch.softmax(torch.randn(22, 5), -1)
    ref_soft = float(np.mean(np.argmax(o.numpy(), 1) == np.argmax(soft.numpy(), 1)))
    assert _run(["accuracy"], _batches(o, soft, SIZES))["accuracy"] == pytest.approx(ref_soft, abs=1e-15)
    # labels [B, 1] and labels held as floats
    assert _run(["accuracy"], [(o, labels[:, None])])["accuracy"] == pytest.approx(ref, abs=1e-15)
    assert _run(["accuracy"], [(o, labels.double())])["accuracy"] == pytest.approx(ref, abs=1e-15)


def test_accuracy_over_sequences_counts_every_position():
    o = torch.randn(4, 6, 3)  # [batch, time, classes]
    labels = torch.randint(0, 3, (4, 6))
    ref = float(np.mean(np.argmax(o.numpy(), axis=-1) == labels.numpy()))
    assert _run(["accuracy"], _batches(o, labels, (1, 3)))["accuracy"] == pytest.approx(ref, abs=1e-15)


def test_accuracy_with_one_column_thresholds_at_half():
    p = torch.rand(22, 1)
    y = (torch.rand(22) > 0.5).long()
    ref = float(np.mean((p.numpy()[:, 0] > 0.5) == (y.numpy() == 1)))
    assert _run(["accuracy"], _batches(p, y, SIZES))["accuracy"] == pytest.approx(ref, abs=1e-15)
    assert _run(["accuracy"], _batches(p, y[:, None].float(), SIZES))["accuracy"] == pytest.approx(ref, abs=1e-15)
    assert _run(["accuracy"], [(p[:, 0], y)])["accuracy"] == pytest.approx(ref, abs=1e-15)  # output [B]


def test_binary_accuracy_is_elementwise():
    p = torch.rand(22, 4)
    y = (torch.rand(22, 4) > 0.5).float()
    ref = float(np.mean((p.numpy() > 0.5) == (y.numpy() > 0.5)))
    assert _run(["binary_accuracy"], _batches(p, y, SIZES))["binary_accuracy"] == pytest.approx(ref, abs=1e-15)


def test_every_name_in_METRIC_NAMES_works():
    assert set(METRIC_NAMES) == {"accuracy", "binary_accuracy", "mse", "mae", "rmse"}
    p = torch.rand(5, 1)
    got = _run(list(METRIC_NAMES), [(p, (p > 0.3).float())])
    assert list(got) == list(METRIC_NAMES)


# ------------------------------------------------------------------------------ callables
def test_callable_metric_is_averaged_weighted_by_batch_size_and_named():
    o, y = torch.randn(22, 2), torch.randn(22, 2)

    def max_error(output, target):  # returns a 0-d tensor per batch
        return (output - target).abs().max()

    class Bias:
        def __call__(self, output, target):  # returns a Python float
            return float((output - target).mean())

    got = _run([max_error, Bias()], _batches(o, y, SIZES))
    batches = _batches(o.numpy().astype(np.float64), y.numpy().astype(np.float64), SIZES)
    n = sum(SIZES)
    ref_max = sum(len(a) * np.abs(a - b).max() for a, b in batches) / n
    ref_bias = sum(len(a) * np.mean(a - b) for a, b in batches) / n
    assert got["max_error"] == pytest.approx(ref_max, rel=1e-6)
    assert got["Bias"] == pytest.approx(ref_bias, rel=1e-5, abs=1e-7)


def test_mapping_chooses_names():
    o, y = torch.randn(6, 3), torch.randint(0, 3, (6,))
    got = _run({"acc": "accuracy", "first_logit": lambda out, t: out[:, 0].mean()}, [(o, y)])
    assert list(got) == ["acc", "first_logit"]
    assert got["acc"] == pytest.approx(float(np.mean(np.argmax(o.numpy(), 1) == y.numpy())), abs=1e-15)
    assert got["first_logit"] == pytest.approx(float(np.mean(o.numpy()[:, 0])), rel=1e-6)


def test_single_name_and_prefix_and_reset():
    o, y = torch.randn(4, 2), torch.randn(4, 2)
    ms = MetricSet("mae")
    assert ms.names == ("mae",) and len(ms) == 1
    ms.update(o * 100, y)
    ms.reset()
    ms.update(o, y)
    got = ms.compute(prefix="val_")
    assert list(got) == ["val_mae"]
    assert got["val_mae"] == pytest.approx(float(np.mean(np.abs(o.numpy().astype(np.float64) - y.numpy()))), rel=1e-6)


# ----------------------------------------------------------------------- update/compute/reset
class MeanAbsStub:
    """A torchmetrics-like object: update/compute/reset, its own state."""

    def __init__(self):
        self.resets = 0
        self.reset()

    def reset(self):
        self.resets += 1
        self.sum, self.n = torch.zeros((), dtype=torch.float64), 0

    def update(self, output, target):
        self.sum += (output - target).abs().sum().double()
        self.n += output.numel()

    def compute(self):
        return self.sum / self.n


def test_protocol_object_is_driven_through_update_compute_reset():
    stub = MeanAbsStub()
    o, y = torch.randn(22, 3), torch.randn(22, 3)
    ms = MetricSet([stub, "mae"])
    assert ms.names == ("MeanAbsStub", "mae")
    for a, b in _batches(o, y, SIZES):
        ms.update(a, b)
    got = ms.compute()
    ref = float(np.mean(np.abs(o.numpy().astype(np.float64) - y.numpy())))
    assert got["MeanAbsStub"] == pytest.approx(ref, rel=1e-6) and got["mae"] == pytest.approx(ref, rel=1e-6)
    before = stub.resets
    ms.reset()
    assert stub.resets == before + 1 and stub.n == 0


def test_torchmetrics_objects_when_installed():
    torchmetrics = pytest.importorskip("torchmetrics")
    o, y = torch.randn(22, 4), torch.randint(0, 4, (22,))
    acc = torchmetrics.classification.MulticlassAccuracy(num_classes=4, average="micro")
    got = _run({"tm_acc": acc, "accuracy": "accuracy"}, _batches(o, y, SIZES))
    ref = float(np.mean(np.argmax(o.numpy(), 1) == y.numpy()))
    assert got["tm_acc"] == pytest.approx(ref, abs=1e-6) and got["accuracy"] == pytest.approx(ref, abs=1e-15)


# -------------------------------------------------------------------------------- no host sync
def test_update_reads_no_values_back_to_the_host(monkeypatch):
    """update() must not call .item()/.tolist()/bool on a tensor; compute() reads once."""
    reads = []
    for meth in ("item", "tolist", "__bool__", "__float__", "__int__"):
        orig = getattr(torch.Tensor, meth)

        def spy(self, *a, _orig=orig, _m=meth, **k):
            reads.append(_m)
            return _orig(self, *a, **k)

        monkeypatch.setattr(torch.Tensor, meth, spy)
    ms = MetricSet(["accuracy", "mse", "mae", "rmse", "binary_accuracy", lambda_free_metric])
    p = torch.rand(8, 1)
    for _ in range(3):
        ms.update(p, (p > 0.5).float())
    assert reads == []
    ms.compute()
    assert reads == ["tolist"]


def lambda_free_metric(output, target):
    return (output - target).mean()


# ------------------------------------------------------------------------------------ bad input
@pytest.mark.parametrize(
    "metrics, exc, match",
    [
        (["acuracy"], ValueError, r"unknown metric name 'acuracy'; valid names: 'accuracy', 'binary_accuracy'"),
        (["Accuracy"], ValueError, "did you mean 'accuracy'"),
        (["mse", "mse"], ValueError, "duplicate metric name 'mse'"),
        ([lambda_free_metric, lambda_free_metric], ValueError, "duplicate metric name 'lambda_free_metric'"),
        ([lambda o, t: o.mean()], ValueError, "'<lambda>'.*needs a name"),
        ([3], TypeError, r"3 \(int\) is not a metric"),
        ([None], TypeError, "is not a metric"),
        ([MeanAbsStub], TypeError, "got the class MeanAbsStub; pass an instance"),
        ({"loss": "mse"}, ValueError, "'loss' is reserved"),
        ({"val_acc": "accuracy"}, ValueError, "'val_acc' is reserved"),
        ({1: "mse"}, TypeError, "mapping keys must be str"),
        (42, TypeError, "metrics must be a sequence"),
    ],
)
def test_bad_metrics(metrics, exc, match):
    with pytest.raises(exc, match=match):
        MetricSet(metrics)


def test_bad_updates_and_values():
    with pytest.raises(ValueError, match=r"metric 'mse': target shape \[4\] does not match output shape \[4, 3\].*accuracy"):
        MetricSet(["mse"]).update(torch.randn(4, 3), torch.randint(0, 3, (4,)))
    with pytest.raises(ValueError, match=r"metric 'accuracy': target must be class labels of shape \[4\]"):
        MetricSet(["accuracy"]).update(torch.randn(4, 3), torch.randint(0, 3, (4, 2)))
    with pytest.raises(ValueError, match="one-column output"):
        MetricSet(["accuracy"]).update(torch.rand(4, 1), torch.rand(4, 2))
    with pytest.raises(TypeError, match="output and target must be tensors"):
        MetricSet(["mse"]).update(np.ones((2, 1)), torch.ones(2, 1))
    per_row = MetricSet({"per_row": lambda o, t: (o - t).abs()})
    with pytest.raises(ValueError, match=r"metric 'per_row' returned a tensor of shape \[3, 2\]"):
        per_row.update(torch.randn(3, 2), torch.randn(3, 2))
    with pytest.raises(TypeError, match="metric 'text' returned str"):
        MetricSet({"text": lambda o, t: "x"}).update(torch.randn(3, 2), torch.randn(3, 2))

    class BadCompute(MeanAbsStub):
        def compute(self):
            return torch.ones(3)

    ms = MetricSet([BadCompute()])
    ms.update(torch.ones(2, 1), torch.ones(2, 1))
    with pytest.raises(ValueError, match=r"compute\(\) returned a tensor of shape \[3\]"):
        ms.compute()
    with pytest.raises(RuntimeError, match="has no batch"):
        MetricSet(["mae"]).compute()
    with pytest.raises(TypeError, match="prefix must be a str"):
        MetricSet(["mae"]).compute(prefix=1)


def test_nan_outputs_give_nan_not_an_error():
    got = _run(["mse", "mae"], [(torch.full((2, 2), math.nan), torch.zeros(2, 2))])
    assert math.isnan(got["mse"]) and math.isnan(got["mae"])
