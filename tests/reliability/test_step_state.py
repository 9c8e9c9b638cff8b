"""Issue 32, items 2, 6 and 8: what a step or an epoch leaves behind.

* item 2, the class "a step that does not count leaves no trace": every module buffer (BatchNorm's
  running mean, variance and batch count) is put back after a skipped step, on the host path and on
  the device runner (run eagerly on CPU with its torch-op kernels), whatever made the step skip (a NaN
  loss, a NaN gradient). The reference is the same run without the bad batch, bit for bit.
* item 6, the class "a metrics mapping or MetricSet means what it says": ``{name: metric}`` logs the
  value's metric under the key (a callable wins over a built-in of that name), and a ``MetricSet``
  is taken as it is, in training and in validation.
* item 8, the class "a non-finite logged value is reported": a NaN ``val_loss`` (or any NaN
  validation value / metric) gives a ``DivergenceWarning`` naming the epoch and the key, the
  history keeps it, and ``Checkpoint`` never takes it as the best.
"""

import copy
import math
import warnings

import pytest
import torch
from torch import nn

from torchloom import Checkpoint, DivergenceWarning, TrainingConfig, evaluate, train
from torchloom.engine.cuda_path import CudaRunner
from torchloom.engine.metrics import MetricSet
from torchloom.engine.train import as_network, make_trainer


def _bn_net():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 6), nn.BatchNorm1d(6), nn.Tanh(), nn.Linear(6, 2))


def _batches(n=4):
    g = torch.Generator().manual_seed(0)
    return [(torch.randn(8, 4, generator=g), torch.randn(8, 2, generator=g)) for _ in range(n)]


def _nan_input(batch):
    x, y = batch
    x = x.clone()
    x[3, 1] = float("nan")
    return x, y


def _run(data, backend=None):
    net = _bn_net()
    cfg = TrainingConfig(epochs=1, verbose=0, optimizer="sgd", learning_rate=0.05)
    if backend is None:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DivergenceWarning)
            result = train(net, data, cfg)
        return net, result
    trainer = make_trainer(as_network(net), cfg)
    trainer.kernel_backend = backend
    trainer._runner = CudaRunner(trainer)  # the device runner, eagerly, on CPU
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DivergenceWarning)
        result = trainer.fit(data, 1)
    return net, result


def _buffers(net):
    return {k: v.clone() for k, v in net.state_dict().items()}


@pytest.mark.parametrize("backend", [None, "reference"], ids=["host", "device-runner"])
def test_a_skipped_nan_loss_batch_leaves_the_running_statistics_as_without_it(backend):
    good = _batches(3)
    want_net, _ = _run(good[:2], backend)  # reference: the same run without the NaN batch
    got_net, result = _run([good[0], good[1], _nan_input(good[2])], backend)
    assert result.skipped_per_epoch == [1]
    for key, value in _buffers(want_net).items():
        assert torch.equal(got_net.state_dict()[key], value), key
    scores = evaluate(got_net, [good[0]])
    assert math.isfinite(scores["loss"])


@pytest.mark.parametrize("backend", [None, "reference"], ids=["host", "device-runner"])
def test_a_skipped_middle_batch_is_undone_whatever_the_status(backend):
    # the NaN batch first: its forward changes the statistics before any later batch runs; the epoch
    # is abandoned (NaN loss), so the run equals a run of no batch at all
    good = _batches(3)
    fresh = _bn_net()
    got_net, result = _run([_nan_input(good[0]), good[1], good[2]], backend)
    assert result.skipped_per_epoch == [3]
    for key, value in fresh.state_dict().items():
        assert torch.equal(got_net.state_dict()[key], value), key


def test_an_update_undone_for_nonfinite_weights_also_undoes_the_statistics():
    # a learning rate so large that the first update overflows the weights: NAN_WEIGHTS, undone
    x, y = _batches(1)[0]
    net = _bn_net()
    before = _buffers(net)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DivergenceWarning)
        result = train(net, [(x, y * 1e6)], TrainingConfig(epochs=1, verbose=0, optimizer="sgd", learning_rate=1e37))
    assert result.skipped_per_epoch == [1]
    for key, value in before.items():
        assert torch.equal(net.state_dict()[key], value), key


# ------------------------------------------------------------------------------------ item 6
def _plain():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 2))


def _xy():
    g = torch.Generator().manual_seed(2)
    return torch.randn(32, 4, generator=g), torch.randn(32, 2, generator=g)


def test_a_metrics_mapping_logs_each_value_under_its_key_and_a_callable_wins():
    X, Y = _xy()
    seen = []

    def my_fn(output, target):
        seen.append(output.shape[0])
        return (output - target).abs().max()

    net = _plain()
    result = train(net, (X, Y), TrainingConfig(epochs=1, verbose=0, batch_size=8, metrics={"mse": my_fn, "mine": "mae"},
                                               validation_data=(X, Y)))
    assert seen  # the callable ran, in training and validation
    h = result.history
    # "mse" is my_fn (a max, not a mean of squares): its validation value recomputed independently
    with torch.no_grad():
        out = net(X)
    want_val_mse = sum(float((out[i:i + 8] - Y[i:i + 8]).abs().max()) * 8 for i in range(0, 32, 8)) / 32
    want_val_mae = float((out - Y).abs().mean())
    assert h["val_mse"][0] == pytest.approx(want_val_mse, rel=1e-6)
    assert h["val_mine"][0] == pytest.approx(want_val_mae, rel=1e-6)
    assert {"mse", "mine"} <= set(h.keys())


def test_a_metric_set_is_taken_as_it_is():
    X, Y = _xy()
    metrics = MetricSet({"err": "mae", "sq": "mse"})
    result = train(_plain(), (X, Y), TrainingConfig(epochs=1, verbose=0, batch_size=8, metrics=metrics, validation_data=(X, Y)))
    assert {"err", "sq", "val_err", "val_sq"} <= set(result.history.keys())


def test_a_metrics_mapping_with_an_unknown_name_fails_at_the_config():
    with pytest.raises(ValueError) as e:
        TrainingConfig(metrics={"acc": "acuracy"})
    assert str(e.value) == (
        "TrainingConfig: metrics: unknown metric name 'acuracy'; valid names: 'accuracy', 'binary_accuracy', "
        "'mse', 'mae', 'rmse' (did you mean 'accuracy'?)"
    )
    with pytest.raises(TypeError) as e:
        TrainingConfig(metrics=3)
    assert str(e.value) == (
        "TrainingConfig: metrics must be a sequence of metric names or callables, e.g. ('accuracy',), a mapping "
        "{name: metric} or a MetricSet, got 3"
    )


# ------------------------------------------------------------------------------------ item 8
def test_a_nan_validation_loss_is_reported_kept_in_history_and_never_the_best(tmp_path):
    X, Y = _xy()
    Xv = X.clone()
    Xv[5, 0] = float("nan")
    path = tmp_path / "best.pt"
    ckpt = Checkpoint(path, monitor="val_loss")
    with pytest.warns(DivergenceWarning) as rec:
        result = train(_plain(), (X, Y), TrainingConfig(epochs=2, verbose=0, batch_size=8, validation_data=(Xv, Y),
                                                        metrics=["mae"], observers=[ckpt]))
    messages = [str(w.message) for w in rec if issubclass(w.category, DivergenceWarning)]
    for epoch in (1, 2):
        assert (
            f"epoch {epoch}: val_loss is nan, val_mae is nan (the model's outputs or the validation data hold NaN/Inf); "
            "a non-finite value is never the best for Checkpoint or EarlyStopping"
        ) in messages
    assert all(math.isnan(v) for v in result.history["val_loss"])
    assert all(math.isfinite(v) for v in result.history["loss"])
    assert ckpt.best_epoch is None and not path.exists()


def test_finite_logs_give_no_warning():
    X, Y = _xy()
    with warnings.catch_warnings():
        warnings.simplefilter("error", DivergenceWarning)
        train(_plain(), (X, Y), TrainingConfig(epochs=1, verbose=0, batch_size=8, validation_data=(X, Y), metrics=["mae"]))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_on_cuda_a_skipped_batch_leaves_the_running_statistics_as_without_it():
    # the device path on a GPU (graph capture when possible): the buffers are saved and put back inside
    # the captured steps
    good = [(x.cuda(), y.cuda()) for x, y in _batches(3)]
    bad = [good[0], good[1], (_nan_input((good[2][0].cpu(), good[2][1].cpu()))[0].cuda(), good[2][1])]

    def run(data):
        net = _bn_net().cuda()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            result = train(net, data, TrainingConfig(epochs=3, verbose=0, optimizer="sgd", learning_rate=0.05, device="cuda"))
        return net, result

    want, _ = run(good[:2])
    got, result = run(bad)
    assert result.skipped_per_epoch == [1, 1, 1]
    for key, value in want.state_dict().items():
        torch.testing.assert_close(got.state_dict()[key], value, rtol=1e-6, atol=1e-7, msg=key)


def test_a_constant_non_finite_buffer_does_not_stop_training():
    """A model that keeps a ``-inf`` mask as a buffer (a constant, not a statistic): the buffer guard
    leaves it out, so every step counts and the weights move as plain SGD's (against torch.optim)."""
    class Masked(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(3, 2)
            self.register_buffer("mask", torch.tensor([0.0, float("-inf")]))

        def forward(self, x):
            return self.lin(x) + self.mask.clamp_min(-1e4) * 0

    torch.manual_seed(0)
    model = Masked()
    ref = copy.deepcopy(model)
    g = torch.Generator().manual_seed(1)
    batches = [(torch.randn(4, 3, generator=g), torch.randn(4, 2, generator=g)) for _ in range(3)]
    r = train(model, batches, TrainingConfig(epochs=1, learning_rate=0.1, verbose=0))
    assert r.skipped_batches == 0
    opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    for x, y in batches:
        opt.zero_grad()
        torch.nn.functional.mse_loss(ref(x), y).backward()
        opt.step()
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p, q)
