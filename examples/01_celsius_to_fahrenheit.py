"""Quick start: learn F = 1.8·C + 32 from six points with one Dense(1→1) layer and train().

Run: python examples/01_celsius_to_fahrenheit.py
"""

from __future__ import annotations

import torch

import torchloom
from torchloom import Dense, Network, TrainingConfig

# Six measured points. Inputs and targets are divided by 100 so that plain SGD sees numbers near 1
# (the learned weight is unchanged by that scaling; the bias is scaled back by 100 below).
CELSIUS = torch.tensor([[-40.0], [-10.0], [0.0], [8.0], [15.0], [38.0]])
FAHRENHEIT = 1.8 * CELSIUS + 32.0
SCALE = 100.0


def main(epochs: int = 1500, verbose: bool = True) -> tuple[float, float]:
    """Train and return the learned ``(w, b)`` of ``F = w·C + b``."""
    torch.manual_seed(0)
    net = Network(Dense(1, 1))  # y = x·w + b, linear activation
    batches = [(CELSIUS / SCALE, FAHRENHEIT / SCALE)]  # one batch of all six points
    config = TrainingConfig(epochs=epochs, learning_rate=0.9, loss_type="mse", verbose=False)
    result = torchloom.train(net, batches, config)
    w = net[0].weight.item()
    b = net[0].bias.item() * SCALE
    if verbose:
        print(f"trained {len(result.loss_history)} epochs in {result.total_time:.2f}s, final loss {result.final_loss:.3e}")
        print(f"learned: F = {w:.4f}·C + {b:.4f}   (true: F = 1.8·C + 32)")
        with torch.no_grad():
            for c in (-40.0, 0.0, 37.0, 100.0):
                f = net(torch.tensor([[c / SCALE]])).item() * SCALE
                print(f"  {c:6.1f} °C -> {f:7.2f} °F (exact {1.8 * c + 32:7.2f})")
    return w, b


if __name__ == "__main__":
    main()
