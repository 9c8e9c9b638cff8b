"""Data-parallel training on several GPUs (or CPU processes) with torchrun, for every method.

    torchrun --nproc_per_node=2 examples/07_multi_gpu.py            # NCCL on 2 GPUs (gloo on CPU without CUDA)
    torchrun --nproc_per_node=2 examples/07_multi_gpu.py --cpu      # gloo on CPU processes
    python examples/07_multi_gpu.py                                 # one process, same numbers

Under an initialised process group ``train()`` trains data-parallel without any other change: each
rank takes its equal share of every global batch of ``batch_size`` rows (here the ``(X, Y)`` tensors
are cut by the engine), the gradients (backprop) or update directions (TargetProp, Tweening) are
all-reduced, every skip / gate / explosion decision is the same on every rank, and only rank 0
prints. The result equals one process training on the global batches: compare the printed accuracy
with ``python examples/07_multi_gpu.py``. Needs scikit-learn (the digits ship with it).
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split

import torchloom
from torchloom import Dense, Network, TrainingConfig, TweenConfig


def load(seed: int = 0):
    """Standardised digits: ``(x_train [n, 64], y_train [n], x_test, y_test)`` as tensors."""
    digits = load_digits()
    x_tr, x_te, y_tr, y_te = train_test_split(digits.data, digits.target, test_size=0.25, random_state=seed, stratify=digits.target)
    x_tr = torch.tensor(x_tr, dtype=torch.float32)
    x_te = torch.tensor(x_te, dtype=torch.float32)
    mean, std = x_tr.mean(0), x_tr.std(0).clamp_min(1e-3)
    return (x_tr - mean) / std, torch.tensor(y_tr), (x_te - mean) / std, torch.tensor(y_te)


def main(epochs: int = 20, cpu: bool = False, verbose: bool = True) -> dict[str, float]:
    """Train a 64-64-10 network with each method, data-parallel when launched by torchrun; return
    the test accuracy per method (the same on every rank)."""
    launched = "RANK" in os.environ and "WORLD_SIZE" in os.environ
    use_cuda = torch.cuda.is_available() and not cpu
    if launched and not dist.is_initialized():
        dist.init_process_group("nccl" if use_cuda else "gloo")
    rank = dist.get_rank() if dist.is_initialized() else 0
    world = dist.get_world_size() if dist.is_initialized() else 1
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if use_cuda else torch.device("cpu")
    if use_cuda:
        torch.cuda.set_device(device)
    x_tr, y_tr, x_te, y_te = load()
    rows = len(x_tr) // 64 * 64  # whole global batches: equal shards on up to 64 ranks, as one process would see them
    x_tr, y_tr = x_tr[:rows], y_tr[:rows]
    results = {}
    methods = {
        "backprop": dict(method="backprop", learning_rate=0.1, loss_type="cross_entropy"),
        "target_prop": dict(method="target_prop", learning_rate=0.002),  # trains on ½Σ(y − t)² (loss "mse")
        "tween": dict(method=TweenConfig(base_rate=0.05), loss_type="cross_entropy"),
    }
    for name, settings in methods.items():
        torch.manual_seed(0)  # rank 0's initial weights are broadcast anyway
        net = Network(Dense(64, 64, "tanh"), Dense(64, 10))
        config = TrainingConfig(
            epochs=epochs, batch_size=64, shuffle=True, seed=0, device=device,
            verbose=2 if verbose else 0, **settings,
        )
        torchloom.train(net, (x_tr, y_tr), config)  # (X, Y): each rank takes its 64/world rows of every batch
        with torch.no_grad():
            results[name] = (net.to("cpu")(x_te).argmax(1) == y_te).float().mean().item()
        if verbose and rank == 0:
            print(f"{name}: test accuracy {results[name]:.2%} ({world} process{'es' if world > 1 else ''})", flush=True)
    if launched:
        dist.barrier()  # every rank done before any tears down
        dist.destroy_process_group()
    return results


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cpu", action="store_true", help="gloo on CPU even when CUDA is present")
    parser.add_argument("--epochs", type=int, default=20)
    args = parser.parse_args()
    main(epochs=args.epochs, cpu=args.cpu)
