"""Validation, metrics, a plain PyTorch module inside the network, checkpoints and exact resume.

Digits (scikit-learn's 8×8, offline) held as tensors ``(X, Y)``: ``train()`` batches and shuffles them,
evaluates the validation split after every epoch (``val_loss``, ``val_accuracy``), keeps the full
training state in a checkpoint, stops early when ``val_loss`` stops improving, and — the point of
resuming — continues a run from its checkpoint to the same weights as an uninterrupted run.

Run: python examples/06_validation_and_resume.py   (any method: add --method tween / target_prop)
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import torch
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split
from torch import nn

import torchloom
from torchloom import Checkpoint, Dense, EarlyStopping, Network, TrainingConfig


def load(seed: int = 0):
    """Digits scaled to [0, 1] as tensors: ``(x_train [n, 64], y_train [n], x_val, y_val)``."""
    digits = load_digits()
    x_tr, x_va, y_tr, y_va = train_test_split(digits.data / 16.0, digits.target, test_size=0.25, random_state=seed, stratify=digits.target)
    return torch.tensor(x_tr, dtype=torch.float32), torch.tensor(y_tr), torch.tensor(x_va, dtype=torch.float32), torch.tensor(y_va)


def make_net() -> Network:
    torch.manual_seed(0)
    # torchloom layers keep their hand-written backward; nn.Dropout trains through autograd on itself
    return Network(Dense(64, 64, "relu"), nn.Dropout(0.1), Dense(64, 10))


def main(method: str = "backprop", epochs: int = 12, verbose: bool = True) -> dict[str, float]:
    """Train with validation and checkpoints, then show that 6 epochs + resume = 12 epochs."""
    x_tr, y_tr, x_va, y_va = load()
    settings = dict(
        method=method, epochs=epochs, batch_size=32, shuffle=True, seed=0,
        validation_data=(x_va, y_va), metrics=("accuracy",), verbose=2 if verbose else 0,
        **({"loss_type": "cross_entropy", "learning_rate": 0.1} if method == "backprop" else {}),
        **({"learning_rate": 0.05, "loss_type": "cross_entropy"} if method == "tween" else {}),
        **({"learning_rate": 0.1, "loss_type": "cross_entropy"} if method == "target_prop" else {}),
    )
    with tempfile.TemporaryDirectory() as tmp:
        best, last = Path(tmp) / "best.pt", Path(tmp) / "last.pt"

        # 1. one run of `epochs` epochs: best checkpoint by val_loss, early stopping on it
        net = make_net()
        observers = [Checkpoint(best, monitor="val_loss"), EarlyStopping(monitor="val_loss", patience=4, restore_best=False)]
        result = torchloom.train(net, (x_tr, y_tr), TrainingConfig(observers=observers, **settings))
        report = torchloom.evaluate(net, (x_va, y_va), loss_type="cross_entropy", metrics=("accuracy",))
        if verbose:
            print(f"{len(result.loss_history)} epochs: val_accuracy {report['accuracy']:.2%}, "
                  f"best val_loss {observers[0].best:.4f} at epoch {observers[0].best_epoch + 1}")

        # 2. the same run cut in two: half the epochs, then resume from the checkpoint of the last epoch
        full = make_net()
        torchloom.train(full, (x_tr, y_tr), TrainingConfig(**settings))
        first = make_net()
        half = dict(settings, epochs=epochs // 2, verbose=0)
        torchloom.train(first, (x_tr, y_tr), TrainingConfig(observers=[Checkpoint(last, save_best_only=False)], **half))
        resumed = make_net()
        torchloom.train(resumed, (x_tr, y_tr), TrainingConfig(resume_from=last, **dict(settings, verbose=0)))
        same = all(torch.equal(a, b) for a, b in zip(full.state_dict().values(), resumed.state_dict().values()))
        if verbose:
            print(f"{epochs // 2} epochs + resume for {epochs - epochs // 2} == {epochs} epochs in one run: {same}")
    predictions = torchloom.predict(net, x_va).argmax(-1)
    return {"val_accuracy": report["accuracy"], "resume_exact": float(same), "predicted": float((predictions == y_va).float().mean())}


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--method", default="backprop", choices=["backprop", "tween", "target_prop"])
    parser.add_argument("--epochs", type=int, default=12)
    args = parser.parse_args()
    main(args.method, args.epochs)
