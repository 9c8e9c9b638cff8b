"""TargetProp on scikit-learn's digits: chain-rule and pure modes against plain backprop.

    python examples/03_target_prop.py

Every method trains the same network, Dense(64→64, tanh) → Dense(64→10), from the same initial
weights on the same standardized split (1347 train / 450 test images, 8×8 pixels, 10 classes), in
batches of 32, for the same number of epochs:

* backprop: ``torchloom.train`` with plain SGD, on cross-entropy and on MSE against one-hot targets;
* TargetProp, chain rule: backward targets from exact gradients, gated and depth-scaled updates;
* TargetProp, pure: backward targets from the weights alone (no derivatives between layers).

Prints a table of test accuracy, epochs and wall time; runs in well under a minute on a laptop CPU.
"""

from __future__ import annotations

import copy
import time

import torch
import torch.nn.functional as F

from torchloom.layers.dense import Dense
from torchloom.layers.network import Network
from torchloom import TargetPropConfig, TargetPropTrainer
from torchloom.engine.train import train


def load_digits_split(batch_size: int = 32):
    """Standardized digits (statistics of the training part only), a fixed stratified 75/25 split."""
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    x, y = load_digits(return_X_y=True)
    x_train, x_test, y_train, y_test = train_test_split(x, y, test_size=0.25, random_state=0, stratify=y)
    mean, std = x_train.mean(0), x_train.std(0) + 1e-8  # some border pixels are always 0
    x_train = torch.tensor((x_train - mean) / std, dtype=torch.float32)
    x_test = torch.tensor((x_test - mean) / std, dtype=torch.float32)
    y_train, y_test = torch.tensor(y_train), torch.tensor(y_test)
    batches = [(x_train[i : i + batch_size], y_train[i : i + batch_size]) for i in range(0, len(x_train), batch_size)]
    return batches, x_test, y_test


def accuracy(net: Network, x: torch.Tensor, y: torch.Tensor) -> float:
    with torch.no_grad():
        return (net(x).argmax(1) == y).float().mean().item()


def main(epochs: int = 30, seed: int = 0, verbose: bool = True) -> dict[str, float]:
    """Train every method; return ``{method: test accuracy}`` and print the table when ``verbose``."""
    torch.manual_seed(seed)
    batches, x_test, y_test = load_digits_split()
    one_hot = [(x, F.one_hot(y, 10).float()) for x, y in batches]
    initial = Network(Dense(64, 64, "tanh"), Dense(64, 10))

    # (name, how to train a fresh copy of the network); learning rates: the best of a small sweep each.
    # Every step here is averaged over the batch (TargetProp's default reduction), so the rates compare.
    methods = [
        ("backprop, SGD, cross-entropy (lr 0.1)",
         lambda net: train(net, batches, epochs=epochs, learning_rate=0.1, loss_type="cross_entropy", verbose=False)),
        ("backprop, SGD, MSE (lr 1.0)",
         lambda net: train(net, one_hot, epochs=epochs, learning_rate=1.0, loss_type="mse", verbose=False)),
        ("TargetProp, chain rule, cross-entropy (lr 0.1)",
         lambda net: TargetPropTrainer(net, TargetPropConfig(mode="chain_rule", learning_rate=0.1, loss_type="cross_entropy")).fit(batches, epochs)),
        ("TargetProp, pure, MSE (lr 0.032)",
         lambda net: TargetPropTrainer(net, TargetPropConfig(mode="pure", learning_rate=0.032)).fit(batches, epochs)),
    ]
    # The first torch.optim optimizer imports torch._dynamo (seconds): do it before the clock runs.
    torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1)
    # A network this small is many tiny matmuls: one thread beats several (by 10x on a busy 2-core box).
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    results = {}
    rows = []
    try:
        for name, fit in methods:
            net = copy.deepcopy(initial)
            start = time.perf_counter()
            fit(net)
            seconds = time.perf_counter() - start
            results[name] = accuracy(net, x_test, y_test)
            rows.append((name, results[name], seconds))
    finally:
        torch.set_num_threads(threads)

    if verbose:
        width = max(len(name) for name, _, _ in rows)
        print(f"{'method':<{width}}  test accuracy  epochs    time")
        for name, acc, seconds in rows:
            print(f"{name:<{width}}  {100 * acc:12.1f}%  {epochs:6d}  {seconds:5.1f} s")
    return results


if __name__ == "__main__":
    main()
