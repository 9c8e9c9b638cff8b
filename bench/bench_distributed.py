"""Data-parallel throughput: 1 GPU vs N GPUs for every torchloom method, next to plain PyTorch DDP.

Run on a machine with 2 GPUs (one process per GPU, NCCL):

    PYTHONPATH=. torchrun --nproc_per_node=2 bench/bench_distributed.py            # full table
    PYTHONPATH=. torchrun --nproc_per_node=2 bench/bench_distributed.py --quick    # fewer steps
    PYTHONPATH=. python bench/bench_distributed.py --dry-run   # 2 gloo CPU processes, toy sizes: a smoke test only

For each network (784-4096-4096-10 and 784-256-256-10, ReLU, fp32, cross-entropy, SGD) and per-GPU
batch (1,024 and 16,384), samples/s over all GPUs:

* ``torchloom`` (``train()``, each method: backprop, Tween, TargetProp with the chain rule and pure
  TargetProp, the engine's device path: steps captured in CUDA
  graphs, the all-reduce inside the captured step): on rank 0 alone with ``distributed=False`` (1 GPU),
  then on every rank with the data-parallel engine (N GPUs, each rank its own batch of the per-GPU
  size: the global batch is N times larger);
* ``DDP``: a plain PyTorch loop (``nn.Sequential`` of ``nn.Linear``/``nn.ReLU``, ``F.cross_entropy``,
  ``torch.optim.SGD``) on one GPU, and wrapped in ``DistributedDataParallel`` on N GPUs.

Steady state: torchloom's best epoch after the first (which captures the graphs); DDP's loop timed
after a warm-up of the same number of steps. Samples/s of N GPUs = N × one rank's batch × steps /
time. Scaling = N-GPU samples/s / 1-GPU samples/s. The table is printed by rank 0 as markdown.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

import torchloom
from torchloom import Dense, Network, TargetPropConfig, TrainingConfig, TweenConfig

NETS = ((784, 4096, 4096, 10), (784, 256, 256, 10))
BATCHES = (1024, 16384)
METHODS = ("backprop", "tween", "tp-chain", "tp-pure")
TOY_NETS = ((16, 32, 32, 4), (16, 8, 8, 4))
TOY_BATCHES = (8,)


def _layers(sizes):
    return [(a, b, i < len(sizes) - 2) for i, (a, b) in enumerate(zip(sizes[:-1], sizes[1:]))]


def _torchloom_net(sizes, dev):
    torch.manual_seed(0)
    return Network(*[Dense(a, b, "relu" if hidden else "linear") for a, b, hidden in _layers(sizes)]).to(dev)


def _torch_net(sizes, dev):
    torch.manual_seed(0)
    mods: list[torch.nn.Module] = []
    for a, b, hidden in _layers(sizes):
        mods.append(torch.nn.Linear(a, b))
        if hidden:
            mods.append(torch.nn.ReLU())
    return torch.nn.Sequential(*mods).to(dev)


def _data(sizes, batch, steps, dev, rank):
    g = torch.Generator().manual_seed(1 + rank)
    x = torch.randn(steps * batch, sizes[0], generator=g).to(dev)
    y = torch.randint(0, sizes[-1], (steps * batch,), generator=g).to(dev)
    return [(x[i * batch : (i + 1) * batch], y[i * batch : (i + 1) * batch]) for i in range(steps)]


def _sync(dev):
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def _method(name: str) -> tuple[Any, str]:
    """``(TrainingConfig.method, loss_type)`` of a method of the table. TargetProp trains on its
    ``"mse"`` target (one-hot labels), the loss its fused device step takes."""
    if name == "backprop":
        return "backprop", "cross_entropy"
    if name == "tween":
        return TweenConfig(base_rate=0.01), "cross_entropy"
    if name == "tp-chain":
        return TargetPropConfig(learning_rate=0.01), "mse"
    if name == "tp-pure":
        return TargetPropConfig(mode="pure", learning_rate=0.01), "mse"
    raise ValueError(f"unknown method {name!r}; one of {METHODS}")


def torchloom_rate(method, sizes, batch, steps, epochs, dev, rank, distributed, graphs=True) -> float:
    """Samples/s of all ranks taking part (``distributed``: every rank; else this one)."""
    net = _torchloom_net(sizes, dev)
    data = _data(sizes, batch, steps, dev, rank)
    m, loss = _method(method)
    cfg = TrainingConfig(
        method=m, loss_type=loss, epochs=epochs, verbose=0, device=dev,
        track_perf=True, distributed=None if distributed else False, cuda_graph=None if graphs else False,
    )
    result = torchloom.train(net, data, cfg)
    rates = [p["samples_per_second"] for p in result.perf[1:]] or [result.perf[0]["samples_per_second"]]
    world = dist.get_world_size() if distributed else 1
    return max(rates) * world


def ddp_rate(sizes, batch, steps, epochs, dev, rank, distributed) -> float:
    model = _torch_net(sizes, dev)
    if distributed:
        model = torch.nn.parallel.DistributedDataParallel(model, device_ids=[dev.index] if dev.type == "cuda" else None)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    data = _data(sizes, batch, steps, dev, rank)

    def run():
        for x, y in data:
            opt.zero_grad(set_to_none=True)
            F.cross_entropy(model(x), y).backward()
            opt.step()

    run()  # warm-up
    _sync(dev)
    best = 0.0
    for _ in range(max(epochs - 1, 1)):
        if distributed:
            dist.barrier()
        start = time.perf_counter()
        run()
        _sync(dev)
        best = max(best, batch * steps / (time.perf_counter() - start))
    return best * (dist.get_world_size() if distributed else 1)


def bench(args: Any, rank: int, world: int, dev: torch.device) -> list[dict[str, Any]]:
    nets = TOY_NETS if args.dry_run else NETS
    batches = TOY_BATCHES if args.dry_run else BATCHES
    rows = []
    for sizes in nets:
        for batch in batches:
            steps = args.steps or (2 if args.dry_run else (16 if args.quick else 64) if batch <= 1024 else (8 if args.quick else 24))
            epochs = args.epochs
            one = {}
            if rank == 0:  # one GPU: rank 0 alone, no process group traffic
                one = {m: torchloom_rate(m, sizes, batch, steps, epochs, dev, rank, False, not args.no_graphs) for m in METHODS}
                one["ddp"] = ddp_rate(sizes, batch, steps, epochs, dev, rank, False)
            if world > 1:
                dist.barrier()
            many = {m: torchloom_rate(m, sizes, batch, steps, epochs, dev, rank, world > 1, not args.no_graphs) for m in METHODS}
            many["ddp"] = ddp_rate(sizes, batch, steps, epochs, dev, rank, world > 1)
            if rank == 0:
                for m in (*METHODS, "ddp"):
                    rows.append(dict(net="-".join(map(str, sizes)), batch=batch, method=m, one=one[m], many=many[m], ddp_many=many["ddp"]))
    return rows


def table(rows: list[dict[str, Any]], world: int, device: str) -> str:
    lines = [
        f"Samples/s, {device}, per-GPU batch; N = {world} GPUs (one process each). fp32, SGD, cross-entropy (TargetProp: its mse target of the one-hot labels).",
        "",
        f"| net | batch/GPU | method | 1 GPU | {world} GPUs | scaling | vs DDP on {world} GPUs |",
        "|---|---:|---|---:|---:|---:|---:|",
    ]
    for r in rows:
        name = "plain PyTorch DDP" if r["method"] == "ddp" else f"torchloom {r['method']}"
        lines.append(
            f"| {r['net']} | {r['batch']:,} | {name} | {r['one']:,.0f} | {r['many']:,.0f} | "
            f"{r['many'] / r['one']:.2f}× | {r['many'] / r['ddp_many']:.2f}× |"
        )
    return "\n".join(lines)


def _run(rank: int, world: int, args: Any, port: int | None = None) -> int:
    use_cuda = torch.cuda.is_available() and not args.dry_run
    if world > 1 and not dist.is_initialized():
        kw = {} if port is None else dict(init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
        dist.init_process_group("nccl" if use_cuda else "gloo", **kw)
    if use_cuda:
        dev = torch.device("cuda", int(os.environ.get("LOCAL_RANK", rank)))
        torch.cuda.set_device(dev)
    else:
        dev = torch.device("cpu")
        torch.set_num_threads(1)
    try:
        rows = bench(args, rank, world, dev)
        if rank == 0:
            name = torch.cuda.get_device_name(dev) if use_cuda else "CPU (gloo, dry run: no timings worth reading)"
            print(table(rows, world, f"{world} × {name}" if world > 1 else name), flush=True)
        if world > 1:
            dist.barrier()  # both ranks done before either tears down (gloo aborts a peer mid-receive)
    finally:
        if world > 1:
            dist.destroy_process_group()
    return 0


def _spawned(rank: int, world: int, args: Any, port: int) -> None:
    _run(rank, world, args, port)
    # Leave without the interpreter's teardown: with gloo, a spawned rank's exit sometimes aborted in
    # a C++ destructor ("terminate called without an active exception", about 1 run in 14 even after
    # the barrier and destroy_process_group), after all its work was done.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dry-run", action="store_true", help="2 gloo CPU processes at toy sizes (smoke test)")
    parser.add_argument("--quick", action="store_true", help="fewer steps per epoch")
    parser.add_argument("--steps", type=int, default=0, help="steps per epoch (default by batch size)")
    parser.add_argument("--epochs", type=int, default=3, help="epochs per measurement (the first captures the graphs)")
    parser.add_argument("--no-graphs", action="store_true", help="torchloom without CUDA graphs (cuda_graph=False)")
    args = parser.parse_args(argv)
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:  # under torchrun
        return _run(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), args)
    if args.dry_run:  # no launcher: spawn 2 local gloo processes
        import socket

        import torch.multiprocessing as mp

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        mp.start_processes(_spawned, args=(2, args, port), nprocs=2, join=True, start_method="spawn")
        return 0
    return _run(0, 1, args)


if __name__ == "__main__":
    sys.exit(main())
