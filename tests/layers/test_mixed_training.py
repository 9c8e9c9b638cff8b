"""``train()`` on networks that mix the layers: Embedding → LSTM/RNN → LastStep → Dense on a token
task, and Conv2D → Flatten → Dense on scikit-learn's 8×8 digits; on CPU and (when present) CUDA."""

from __future__ import annotations

import pytest
import torch

from torchloom.layers.conv import Conv2D, Flatten
from torchloom.layers.dense import Dense
from torchloom.layers.embedding import Embedding
from torchloom.layers.lstm import LSTM
from torchloom.layers.network import Network
from torchloom.layers.rnn import RNN, LastStep
from torchloom.engine.train import TrainingConfig, train

VOCAB, STEPS = 6, 6


def _token_task(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Token sequences ``[n, STEPS]`` and their label: how many times token 1 occurs, capped at 3
    (4 classes; the answer needs the whole sequence, so the recurrence must carry it)."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randint(0, VOCAB, (n, STEPS), generator=gen)
    return x, (x == 1).sum(1).clamp(max=3)


def _digits():
    datasets = pytest.importorskip("sklearn.datasets")
    d = datasets.load_digits()
    order = torch.randperm(len(d.target), generator=torch.Generator().manual_seed(0))
    x = torch.tensor(d.images, dtype=torch.float32)[order].unsqueeze(1) / 16.0  # [1797, 1, 8, 8] in [0, 1]
    y = torch.tensor(d.target)[order]
    return x[:1200], y[:1200], x[1200:], y[1200:]


def _accuracy(net: Network, x: torch.Tensor, y: torch.Tensor) -> float:
    with torch.no_grad():
        return (net.forward_saved(x)[0].argmax(-1) == y).float().mean().item()


def _sequence_run(recurrent: type, device: str) -> tuple[list[float], float]:
    torch.manual_seed(0)
    net = Network(Embedding(VOCAB, 8), recurrent(8, 16), LastStep(), Dense(16, 4))
    x, y = _token_task(512, seed=1)
    batches = [(x[i : i + 32], y[i : i + 32]) for i in range(0, len(x), 32)]
    config = TrainingConfig(
        epochs=6, learning_rate=0.1, loss_type="cross_entropy", optimizer="momentum", gradient_clip=1.0, verbose=False,
        device=device, seed=0,
    )
    result = train(net, batches, config)
    assert all(p.device.type == torch.device(device).type for p in net.parameters())
    x_test, y_test = _token_task(500, seed=2)
    return result.loss_history, _accuracy(net, x_test.to(device), y_test.to(device))


def _digits_run(device: str) -> tuple[list[float], float]:
    torch.manual_seed(0)
    x_tr, y_tr, x_te, y_te = _digits()
    net = Network(Conv2D(1, 8, 3, activation="relu"), Flatten(), Dense(8 * 6 * 6, 10))
    batches = [(x_tr[i : i + 64], y_tr[i : i + 64]) for i in range(0, len(x_tr), 64)]
    config = TrainingConfig(
        epochs=5, learning_rate=0.05, loss_type="cross_entropy", optimizer="momentum", verbose=False,
        device=device, seed=0,
    )
    result = train(net, batches, config)
    return result.loss_history, _accuracy(net, x_te.to(device), y_te.to(device))


def _chance_loss(classes: int) -> float:
    return float(torch.log(torch.tensor(float(classes))))


@pytest.mark.parametrize("recurrent", [LSTM, RNN], ids=["LSTM", "RNN"])
def test_embedding_recurrent_dense_learns_token_counts(recurrent):
    losses, accuracy = _sequence_run(recurrent, "cpu")
    assert losses[0] < 1.1 * _chance_loss(4)  # starts near chance
    assert losses[-1] < 0.25 * losses[0], losses
    assert accuracy > 0.9, accuracy


def test_conv2d_dense_learns_digits():
    losses, accuracy = _digits_run("cpu")
    assert losses[-1] < 0.25 * losses[0], losses
    assert accuracy > 0.9, accuracy


@pytest.mark.cuda
def test_mixed_networks_learn_on_cuda():
    losses, accuracy = _sequence_run(LSTM, "cuda")
    assert losses[-1] < 0.25 * losses[0], losses
    assert accuracy > 0.9, accuracy
    losses, accuracy = _digits_run("cuda")
    assert losses[-1] < 0.25 * losses[0], losses
    assert accuracy > 0.9, accuracy
