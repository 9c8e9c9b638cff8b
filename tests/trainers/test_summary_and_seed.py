"""``torchloom.summary`` and ``train(model_factory, ...)`` seeded by ``TrainingConfig.seed`` (issue 33, item 10)."""

from __future__ import annotations

import pytest
import torch

import torchloom
from torchloom import Dense, Network, TrainingConfig


def _rows(text: str) -> list[list[str]]:
    """The table's body rows, split on runs of two or more spaces."""
    import re

    lines = text.splitlines()
    body = lines[2 : lines.index("")]
    return [re.split(r"\s{2,}", line.strip()) for line in body]


def test_summary_of_a_network() -> None:
    net = Network(Dense(784, 128, activation="relu"), Dense(128, 10), torch.nn.Dropout(0.1))
    text = torchloom.summary(net, (2, 784))
    assert text.splitlines()[0].split() == ["Layer", "Type", "Output", "shape", "Params"]
    assert _rows(text) == [
        ["layers.0", "Dense", "[2, 128]", f"{784 * 128 + 128:,}"],
        ["layers.1", "Dense", "[2, 10]", f"{128 * 10 + 10:,}"],
        ["layers.2", "Dropout", "[2, 10]", "0"],
    ]
    total = 784 * 128 + 128 + 128 * 10 + 10
    assert text.splitlines()[-3:] == [f"Total params: {total:,}", f"Trainable params: {total:,}", "Non-trainable params: 0"]
    assert net.training  # modes put back


def test_summary_of_a_plain_module_with_frozen_and_several_inputs() -> None:
    model = torch.nn.Sequential(torch.nn.Conv2d(1, 4, 3), torch.nn.ReLU(), torch.nn.Flatten(), torch.nn.Linear(144, 3))
    model[0].weight.requires_grad_(False)
    text = torchloom.summary(model, (1, 1, 8, 8))
    assert _rows(text) == [
        ["0", "Conv2d", "[1, 4, 6, 6]", "40"],
        ["1", "ReLU", "[1, 4, 6, 6]", "0"],
        ["2", "Flatten", "[1, 144]", "0"],
        ["3", "Linear", "[1, 3]", "435"],
    ]
    assert text.splitlines()[-2:] == ["Trainable params: 439", "Non-trainable params: 36"]

    class Two(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = torch.nn.Linear(3, 2), torch.nn.Linear(4, 2)

        def forward(self, x1: torch.Tensor, x2: torch.Tensor) -> torch.Tensor:
            return self.a(x1) + self.b(x2)

    assert _rows(torchloom.summary(Two(), [(5, 3), (5, 4)])) == [["a", "Linear", "[5, 2]", "8"], ["b", "Linear", "[5, 2]", "10"]]
    with pytest.raises(ValueError) as e:
        torchloom.summary(Two(), (0, 3))
    assert str(e.value) == (
        "summary: input_shape must be the shape of one input batch including the batch dimension, e.g. (1, 784), "
        "or a list of such shapes for a model of several inputs; got (0, 3)"
    )


def test_seed_covers_the_weights_of_a_model_factory() -> None:
    data = [(torch.randn(4, 3), torch.randn(4, 2))]

    def build() -> Network:
        return Network(Dense(3, 5, activation="tanh"), Dense(5, 2))

    torch.manual_seed(123)  # different global states before each call: the seed decides alone
    a = torchloom.train(build, data, TrainingConfig(epochs=2, seed=7, verbose=0))
    torch.manual_seed(456)
    b = torchloom.train(build, data, TrainingConfig(epochs=2, seed=7, verbose=0))
    assert isinstance(a.model, Network) and a.model is not b.model
    for p, q in zip(a.model.parameters(), b.model.parameters()):
        assert torch.equal(p, q)
    assert a.loss_history == b.loss_history
    torch.manual_seed(7)  # independent reference: the factory's weights right after manual_seed(seed)
    fresh = build()
    c = torchloom.train(build, data, TrainingConfig(epochs=1, seed=7, verbose=0, learning_rate=1e-300))
    for p, q in zip(fresh.parameters(), c.model.parameters()):
        assert torch.allclose(p, q, rtol=0, atol=1e-12)
    net = build()
    assert torchloom.train(net, data, TrainingConfig(epochs=1, verbose=0)).model is net

    class Small(torch.nn.Module):  # an nn.Module class is a factory too (Lightning's habit)
        def __init__(self) -> None:
            super().__init__()
            self.lin = torch.nn.Linear(3, 2)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.lin(x)

    d = torchloom.train(Small, data, TrainingConfig(epochs=1, seed=3, verbose=0, learning_rate=1e-300))
    torch.manual_seed(3)
    assert isinstance(d.model, Small) and torch.allclose(d.model.lin.weight, Small().lin.weight, rtol=0, atol=1e-12)
    with pytest.raises(TypeError) as e:
        torchloom.train(lambda: "not a model", data, TrainingConfig(epochs=1, verbose=0))
    assert str(e.value) == "model: the factory '<lambda>' must return an nn.Module (e.g. a torchloom Network), got str"
