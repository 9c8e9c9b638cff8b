"""Loom's other layers with train(): a small convolutional network on scikit-learn's 8×8 digits, and
a small sequence model (Embedding → LSTM → last step → Dense) that counts a token.

Run: python examples/05_layers.py   (needs scikit-learn; the data ships with it, nothing downloads)

Every layer here trains through its hand-written backward: Conv2D's (the explicit convolution
backward primitive), Flatten's, Embedding's scatter-add, the LSTM's backpropagation through time,
LastStep's and Dense's.
"""

from __future__ import annotations

import torch
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split

import torchloom
from torchloom import Dense, Network, TrainingConfig
from torchloom.layers.conv import Conv2D, Flatten
from torchloom.layers.embedding import Embedding
from torchloom.layers.lstm import LSTM
from torchloom.layers.rnn import LastStep


def load_digit_images(seed: int = 0):
    """Digits as images: ``(x_train [n, 1, 8, 8], y_train [n], x_test, y_test)``, pixels in [0, 1]."""
    digits = load_digits()
    x_tr, x_te, y_tr, y_te = train_test_split(digits.images, digits.target, test_size=0.25, random_state=seed, stratify=digits.target)
    as_images = lambda a: torch.tensor(a, dtype=torch.float32).unsqueeze(1) / 16.0  # noqa: E731
    return as_images(x_tr), torch.tensor(y_tr), as_images(x_te), torch.tensor(y_te)


def conv_digits(epochs: int = 8, verbose: bool = True) -> float:
    """Conv2D(1→8, 3×3, pad 1) → Conv2D(8→16, 3×3, stride 2) → Flatten → Dense(144→10); returns the
    test accuracy."""
    torch.manual_seed(0)
    x_tr, y_tr, x_te, y_te = load_digit_images()
    net = Network(
        Conv2D(1, 8, 3, padding=1, activation="relu"),  # [B, 1, 8, 8] → [B, 8, 8, 8]
        Conv2D(8, 16, 3, stride=2, activation="relu"),  # → [B, 16, 3, 3]: ⌊(8 − 3)/2⌋ + 1 = 3
        Flatten(),  # → [B, 144]
        Dense(16 * 3 * 3, 10),  # logits; softmax lives in the loss
    )
    batches = [(x_tr[i : i + 32], y_tr[i : i + 32]) for i in range(0, len(x_tr), 32)]
    config = TrainingConfig(epochs=epochs, learning_rate=0.05, loss_type="cross_entropy", optimizer="momentum", verbose=verbose)
    result = torchloom.train(net, batches, config)
    with torch.no_grad():
        accuracy = (net(x_te).argmax(1) == y_te).float().mean().item()
    if verbose:
        print(f"conv net: final loss {result.final_loss:.4f}, test accuracy {accuracy:.2%} on {len(y_te)} held-out digits")
    return accuracy


def token_sequences(n: int, seed: int, vocab: int = 6, steps: int = 8):
    """Random token sequences ``[n, steps]`` and how many times token 1 occurs in each, capped at 3."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randint(0, vocab, (n, steps), generator=gen)
    return x, (x == 1).sum(1).clamp(max=3)


def count_tokens(epochs: int = 8, verbose: bool = True) -> float:
    """Embedding(6→8) → LSTM(8→16) → LastStep → Dense(16→4) learns to count token 1 in a sequence of
    8 tokens (classes 0, 1, 2, 3+); returns the accuracy on fresh sequences."""
    torch.manual_seed(0)
    net = Network(Embedding(6, 8), LSTM(8, 16), LastStep(), Dense(16, 4))
    x, y = token_sequences(1024, seed=1)
    batches = [(x[i : i + 32], y[i : i + 32]) for i in range(0, len(x), 32)]
    config = TrainingConfig(
        epochs=epochs, learning_rate=0.1, loss_type="cross_entropy", optimizer="momentum", gradient_clip=1.0, verbose=verbose
    )
    result = torchloom.train(net, batches, config)
    x_test, y_test = token_sequences(1000, seed=2)
    with torch.no_grad():
        accuracy = (net(x_test).argmax(1) == y_test).float().mean().item()
    if verbose:
        print(f"sequence model: final loss {result.final_loss:.4f}, accuracy {accuracy:.2%} on {len(y_test)} fresh sequences")
        sample = x_test[:3]
        with torch.no_grad():
            guesses = net(sample).argmax(1).tolist()
        for tokens, guess in zip(sample.tolist(), guesses):
            print(f"  {tokens} → token 1 occurs {guess if guess < 3 else '3+'} time(s)")
    return accuracy


def main(verbose: bool = True) -> tuple[float, float]:
    """Run both; return ``(conv test accuracy, sequence accuracy)``."""
    return conv_digits(verbose=verbose), count_tokens(verbose=verbose)


if __name__ == "__main__":
    main()
