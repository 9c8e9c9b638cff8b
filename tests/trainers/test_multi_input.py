"""Models of several inputs (batches ``((x1, x2), y)``), ``TrainingConfig.loss_fn`` and
``accumulate_grad_batches``: each against a plain PyTorch loop in float64 (issue 33, items 7 and 10)."""

from __future__ import annotations

import warnings
import copy

import pytest
import torch
import torch.nn.functional as F

import torchloom
from torchloom import TrainingConfig
from tests.helpers import assert_close


class TwoInputs(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Linear(3, 2)
        self.b = torch.nn.Linear(4, 2)

    def forward(self, x1: torch.Tensor, x2: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.a(x1)) + self.b(x2)


def _two_input_data(n_batches: int = 4, rows: int = 5) -> list:
    g = torch.Generator().manual_seed(1)
    return [
        ((torch.randn(rows, 3, generator=g, dtype=torch.float64), torch.randn(rows, 4, generator=g, dtype=torch.float64)),
         torch.randn(rows, 2, generator=g, dtype=torch.float64))
        for _ in range(n_batches)
    ]


def _torch_loop(model: torch.nn.Module, data: list, epochs: int, lr: float, loss_fn, accumulate: int = 1) -> list[float]:
    """The reference: plain autograd and torch.optim.SGD; with ``accumulate`` > 1, the gradients of
    each group of batches averaged and one step (the last group of an epoch may be shorter)."""
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    losses = []
    for _ in range(epochs):
        total = 0.0
        for start in range(0, len(data), accumulate):
            group = data[start : start + accumulate]
            opt.zero_grad()
            for x, y in group:
                out = model(*x) if isinstance(x, tuple) else model(x)
                loss = loss_fn(out, y)
                (loss / len(group)).backward()
                total += loss.item()
            opt.step()
        losses.append(total / len(data))
    return losses


def test_two_input_model_matches_a_torch_loop() -> None:
    torch.manual_seed(0)
    model = TwoInputs().double()
    ref = copy.deepcopy(model)
    data = _two_input_data()
    result = torchloom.train(model, data, TrainingConfig(epochs=3, learning_rate=0.1, verbose=0, validation_data=data))
    expected = _torch_loop(ref, data, 3, 0.1, F.mse_loss)
    assert_close(torch.tensor(result.loss_history), torch.tensor(expected), name="epoch losses", rtol=1e-10, atol=1e-12)
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        assert_close(p, q, name=name, rtol=1e-10, atol=1e-12)
    with torch.no_grad():  # val_loss: the trained model on the same data, mean over the (equal) batches
        val = sum(F.mse_loss(ref(*x), y).item() for x, y in data) / len(data)
    assert result.history["val_loss"][-1] == pytest.approx(val, rel=1e-10)
    # evaluate / the model itself take the inputs the same way
    scores = torchloom.evaluate(model, data, loss_type="mse")
    assert scores["loss"] == pytest.approx(val, rel=1e-10)


def test_loss_fn_replaces_loss_type() -> None:
    torch.manual_seed(0)
    model = TwoInputs().double()
    ref = copy.deepcopy(model)
    data = _two_input_data()
    result = torchloom.train(model, data, TrainingConfig(epochs=2, learning_rate=0.05, verbose=0, loss_fn=F.smooth_l1_loss))
    expected = _torch_loop(ref, data, 2, 0.05, F.smooth_l1_loss)
    assert_close(torch.tensor(result.loss_history), torch.tensor(expected), name="epoch losses", rtol=1e-10, atol=1e-12)
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        assert_close(p, q, name=name, rtol=1e-10, atol=1e-12)


def test_loss_fn_with_torchloom_layers_and_class_labels() -> None:
    """A custom loss over a torchloom Network: its hand-written backward takes autograd's output gradient."""
    torch.manual_seed(0)
    net = torchloom.Network(torchloom.Dense(4, 3, activation="linear")).double()
    lin = torch.nn.Linear(4, 3).double()
    with torch.no_grad():
        lin.weight.copy_(net[0].weight)  # Dense keeps nn.Linear's layout, [out, in]
        lin.bias.copy_(net[0].bias)
    g = torch.Generator().manual_seed(2)
    data = [(torch.randn(6, 4, generator=g, dtype=torch.float64), torch.randint(0, 3, (6,), generator=g)) for _ in range(3)]

    def weighted_ce(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(out, y, weight=torch.tensor([1.0, 2.0, 0.5], dtype=out.dtype))

    assert_close(net(data[0][0]), lin(data[0][0]), name="same start", rtol=0, atol=1e-12)
    result = torchloom.train(net, data, TrainingConfig(epochs=2, learning_rate=0.1, verbose=0, loss_fn=weighted_ce))
    expected = _torch_loop(lin, data, 2, 0.1, weighted_ce)
    assert_close(torch.tensor(result.loss_history), torch.tensor(expected), name="epoch losses", rtol=1e-10, atol=1e-12)
    assert_close(net(data[0][0]), lin(data[0][0]), name="trained outputs", rtol=1e-10, atol=1e-12)


def test_loss_fn_bad_result_and_bad_setting() -> None:
    data = _two_input_data(1)
    with pytest.raises(ValueError) as e:
        torchloom.train(TwoInputs().double(), data, TrainingConfig(epochs=1, verbose=0, loss_fn=lambda o, y: (o - y) ** 2))
    assert str(e.value) == (
        "loss_fn '<lambda>' returned a tensor of shape [5, 2]; it must return a one-element tensor (the batch's "
        "mean loss, e.g. reduction='mean') computed from the output"
    )
    with pytest.raises(TypeError) as e:
        TrainingConfig(loss_fn="mae")
    assert str(e.value) == "TrainingConfig: loss_fn must be None or a callable loss_fn(output, target) -> one-element tensor, got 'mae'"
    with pytest.raises(ValueError) as e:
        TrainingConfig(loss_fn=F.l1_loss, method="tween")
    assert str(e.value) == (
        "TrainingConfig: loss_fn is for backprop; method TweenConfig trains on its own loss (set loss_type, or use method='backprop')"
    )


@pytest.mark.parametrize("method", ["target_prop", "tween"])
def test_one_input_methods_refuse_a_tuple_of_inputs(method: str) -> None:
    data = [((torch.randn(5, 3), torch.randn(5, 3)), torch.randn(5, 2))]
    net = torchloom.Network(torchloom.Dense(3, 2))
    before = [p.detach().clone() for p in net.parameters()]
    with pytest.raises(TypeError) as e:
        torchloom.train(net, data, TrainingConfig(epochs=1, verbose=0, method=method))
    assert str(e.value) == (
        f"batch 0: input is a tuple of 2 inputs; method {method!r} trains models of one input tensor "
        "(backprop trains models of several: model(*inputs))"
    )
    assert all(torch.equal(p, b) for p, b in zip(net.parameters(), before))


def test_a_tuple_for_a_network_of_one_input_is_a_clear_error() -> None:
    data = [((torch.randn(5, 3), torch.randn(5, 3)), torch.randn(5, 2))]
    with pytest.raises(TypeError) as e:
        torchloom.train(torchloom.Network(torchloom.Dense(3, 2)), data, TrainingConfig(epochs=1, verbose=0))
    assert str(e.value) == (
        "batch 0: input is a tuple of 2 inputs, but the model's first layer Dense takes one input tensor; a model of "
        "several inputs is an nn.Module whose forward takes them (model(*inputs))"
    )


# ------------------------------------------------------------------ gradient accumulation
@pytest.mark.parametrize("n_batches", [6, 7])  # 7: the epoch's last group holds one batch
def test_accumulate_grad_batches_matches_a_torch_loop(n_batches: int) -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Tanh(), torch.nn.Linear(4, 2)).double()
    ref = copy.deepcopy(model)
    g = torch.Generator().manual_seed(3)
    data = [(torch.randn(4, 3, generator=g, dtype=torch.float64), torch.randn(4, 2, generator=g, dtype=torch.float64)) for _ in range(n_batches)]
    result = torchloom.train(model, data, TrainingConfig(epochs=2, learning_rate=0.2, verbose=0, accumulate_grad_batches=3))
    expected = _torch_loop(ref, data, 2, 0.2, F.mse_loss, accumulate=3)
    assert_close(torch.tensor(result.loss_history), torch.tensor(expected), name="epoch losses", rtol=1e-10, atol=1e-12)
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        assert_close(p, q, name=name, rtol=1e-10, atol=1e-12)


def test_accumulation_equals_one_step_on_the_larger_batch() -> None:
    """k equal batches of a mean loss, accumulated: the weights of one step on their concatenation."""
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2).double()
    big = copy.deepcopy(model)
    g = torch.Generator().manual_seed(4)
    data = [(torch.randn(4, 3, generator=g, dtype=torch.float64), torch.randn(4, 2, generator=g, dtype=torch.float64)) for _ in range(4)]
    torchloom.train(model, data, TrainingConfig(epochs=1, learning_rate=0.3, verbose=0, accumulate_grad_batches=4))
    x = torch.cat([x for x, _ in data])
    y = torch.cat([y for _, y in data])
    F.mse_loss(big(x), y).backward()
    with torch.no_grad():
        for p in big.parameters():
            p -= 0.3 * p.grad
    for (name, p), q in zip(model.named_parameters(), big.parameters()):
        assert_close(p, q, name=name, rtol=1e-10, atol=1e-12)


def test_accumulate_grad_batches_checks() -> None:
    with pytest.raises(ValueError) as e:
        TrainingConfig(accumulate_grad_batches=0)
    assert str(e.value) == "TrainingConfig: accumulate_grad_batches must be an int >= 1 (1 = an update every batch), got 0"
    with pytest.raises(ValueError) as e:
        TrainingConfig(accumulate_grad_batches=2, method="target_prop")
    assert str(e.value) == (
        "TrainingConfig: accumulate_grad_batches=2 is for backprop; method TargetPropConfig updates the weights from "
        "every batch by its own rule (leave it at 1)"
    )


def test_whole_tensors_of_several_inputs_are_batched_alike() -> None:
    """((X1, X2), Y) with batch_size: the same run as the list of row batches (Keras' fit([x1, x2], y))."""
    g = torch.Generator().manual_seed(5)
    X1, X2 = torch.randn(20, 3, generator=g, dtype=torch.float64), torch.randn(20, 4, generator=g, dtype=torch.float64)
    Y = torch.randn(20, 2, generator=g, dtype=torch.float64)
    torch.manual_seed(0)
    a = TwoInputs().double()
    b = copy.deepcopy(a)
    ra = torchloom.train(a, ((X1.numpy(), X2), Y), TrainingConfig(epochs=2, batch_size=8, verbose=0))
    listed = [((X1[i : i + 8], X2[i : i + 8]), Y[i : i + 8]) for i in range(0, 20, 8)]
    rb = torchloom.train(b, listed, TrainingConfig(epochs=2, verbose=0))
    assert ra.loss_history == rb.loss_history
    with pytest.raises(ValueError) as e:
        torchloom.train(TwoInputs().double(), ((X1, X2[:5]), Y), TrainingConfig(epochs=1, verbose=0))
    assert str(e.value) == (
        "batches: the inputs (X1, X2, ...) must be tensors [n, ...] with the same number of rows, got shapes [[20, 3], [5, 4]]"
    )


def test_an_abandoned_epoch_with_accumulation_steps_the_schedule_once_per_missed_update():
    """A NaN loss abandons an epoch: the schedule catches up by the updates the epoch did not reach
    (one per ``accumulate_grad_batches`` batches, the last group counted), so the next epoch starts
    at the same step of the schedule as a run without the bad batch."""
    import torchloom

    seen = []

    def schedule(step):
        seen.append(step)
        return 0.01

    g = torch.Generator().manual_seed(3)
    batches = [(torch.randn(4, 3, generator=g), torch.randn(4, 2, generator=g)) for _ in range(5)]
    batches[1] = (batches[1][0].clone().fill_(float("nan")), batches[1][1])  # epoch 1 stops at its second batch
    torch.manual_seed(0)
    net = torchloom.Network(torchloom.Dense(3, 2))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torchloom.train(net, batches, torchloom.TrainingConfig(epochs=1, accumulate_grad_batches=2, scheduler=schedule, verbose=0))
    # 5 batches in groups of 2 → 3 updates an epoch: the schedule stepped 3 times in all
    assert max(seen) == 3
