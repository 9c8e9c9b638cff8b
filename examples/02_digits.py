"""Classify scikit-learn's 8×8 digits with a 64-32-10 Loom-style network and train().

Run: python examples/02_digits.py   (needs scikit-learn; the data ships with it, nothing downloads)
"""

from __future__ import annotations

import torch
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split

import torchloom
from torchloom import Dense, Network, TrainingConfig


def load(seed: int = 0):
    """Standardised digits: ``(x_train [n, 64], y_train [n], x_test, y_test)`` as tensors."""
    digits = load_digits()
    x_tr, x_te, y_tr, y_te = train_test_split(digits.data, digits.target, test_size=0.25, random_state=seed, stratify=digits.target)
    x_tr = torch.tensor(x_tr, dtype=torch.float32)
    x_te = torch.tensor(x_te, dtype=torch.float32)
    mean, std = x_tr.mean(0), x_tr.std(0).clamp_min(1e-3)
    return (x_tr - mean) / std, torch.tensor(y_tr), (x_te - mean) / std, torch.tensor(y_te)


def main(epochs: int = 30, verbose: bool = True) -> float:
    """Train and return the test accuracy."""
    torch.manual_seed(0)
    x_tr, y_tr, x_te, y_te = load()
    net = Network(Dense(64, 32, "relu"), Dense(32, 10))  # logits; softmax lives in the loss
    batches = [(x_tr[i : i + 32], y_tr[i : i + 32]) for i in range(0, len(x_tr), 32)]
    config = TrainingConfig(epochs=epochs, learning_rate=0.1, loss_type="cross_entropy", verbose=verbose)
    result = torchloom.train(net, batches, config)
    with torch.no_grad():
        accuracy = (net(x_te).argmax(1) == y_te).float().mean().item()
    if verbose:
        print(f"final loss {result.final_loss:.4f}, {result.samples_per_second:,.0f} samples/s")
        print(f"test accuracy: {accuracy:.2%} on {len(y_te)} held-out digits")
    return accuracy


if __name__ == "__main__":
    main()
