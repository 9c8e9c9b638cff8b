"""One rank of ``test_distributed_launch.py``'s two-"node" run (started by ``torchrun --nnodes=2``):
trains every method data-parallel on gloo, and a ``DistributedDataParallel``-wrapped model, saves
the weights and loss histories to ``<out>/node<RANK>.pt`` and prints ``LAST_EPOCH <time>``; it never
calls ``destroy_process_group`` (the process must exit all the same)."""

from __future__ import annotations

import os
import sys
import time
import warnings

import torch
import torch.distributed as dist

from torchloom import Dense, Network, TargetPropConfig, TrainingConfig, TweenConfig, train

METHODS = {
    "backprop": dict(method="backprop", loss_type="cross_entropy", optimizer="momentum", learning_rate=0.05),
    "tp-chain": dict(method=TargetPropConfig(learning_rate=0.05, gate_threshold=0.3)),
    "tween": dict(method=TweenConfig(base_rate=0.05), loss_type="cross_entropy"),
}


def net() -> Network:
    torch.manual_seed(0)
    return Network(Dense(6, 12, "tanh", dtype=torch.float64), Dense(12, 4, "sigmoid", dtype=torch.float64))


def data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randn(64, 6, generator=g, dtype=torch.float64), torch.randint(0, 4, (64,), generator=g)


def config(name: str, **kw) -> TrainingConfig:
    return TrainingConfig(**{"epochs": 3, "verbose": 0, "batch_size": 16, "shuffle": True, "seed": 3, **METHODS[name], **kw})


def main(out: str) -> int:
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    results = {"world": dist.get_world_size(), "local_world": int(os.environ["LOCAL_WORLD_SIZE"]), "group_rank": int(os.environ["GROUP_RANK"])}
    for name in METHODS:
        model = net()
        r = train(model, data(), config(name))
        results[name] = ([p.detach().clone() for p in model.parameters()], r.loss_history)
    model = net()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the note that the DDP wrapper's .module is trained
        train(torch.nn.parallel.DistributedDataParallel(model), data(), config("backprop"))
    results["ddp"] = [p.detach().clone() for p in model.parameters()]
    torch.save(results, os.path.join(out, f"node{dist.get_rank()}.pt"))
    print(f"LAST_EPOCH {time.time():.6f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
