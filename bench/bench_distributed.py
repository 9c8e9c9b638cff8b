"""Data-parallel throughput: 1 GPU vs N GPUs for every torchloom method, next to plain PyTorch DDP.

Run on a machine with 2 GPUs (one process per GPU, NCCL):

    PYTHONPATH=. torchrun --nproc_per_node=2 bench/bench_distributed.py            # full table
    PYTHONPATH=. torchrun --nproc_per_node=2 bench/bench_distributed.py --quick    # fewer steps
    PYTHONPATH=. python bench/bench_distributed.py --dry-run   # 2 gloo CPU processes, toy sizes: a smoke test only
    PYTHONPATH=. python bench/bench_distributed.py --one-gpu-profile   # 1 GPU: backprop step vs PyTorch, kernels per step
    PYTHONPATH=. python bench/bench_distributed.py --quick --nets 784-4096-4096-10 --batches 1024 --methods tp-pure   # a part of the table

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

Backprop and DDP side by side: on 1 GPU and on N, torchloom backprop and the DDP loop are timed
alternately in ``--rounds`` rounds in the same process (the order flips every round, so a drift of
the clock or of the machine hits both alike); the table takes each one's best round, and rank 0
prints every round's pair and its ratio, so the noise behind the "vs DDP" column is visible. The
other methods run once per setting.

A run that skipped batches (a NaN/Inf loss, gradient or weight: the method diverged) is marked ⚠ in
the table with the count: a device epoch abandoned at a NaN loss still replays its masked steps, so
its samples/s counts only the batches that ran, and the number is no step rate. TargetProp runs at
rates that stay finite on these nets (``TP_RATES``): pure mode's delta rule ``gapᵀ x`` at 0.01
diverges on the 784-4096-4096-10 net within one epoch at batch 1,024 (run E's and G's 18× low
1-GPU tp-pure figure: every later epoch stopped at its first batch).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
import warnings
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

import torchloom
from torchloom import Dense, DivergenceWarning, Network, TargetPropConfig, TrainingConfig, TweenConfig

NETS = ((784, 4096, 4096, 10), (784, 256, 256, 10))
BATCHES = (1024, 16384)
METHODS = ("backprop", "tween", "tp-chain", "tp-pure")
TOY_NETS = ((16, 32, 32, 4), (16, 8, 8, 4))
TOY_BATCHES = (8,)
# TargetProp's learning rate per mode (``--tp-pure-lr`` overrides pure mode's). Pure mode's delta rule
# is an LMS step per layer, stable only below ~2 / |x|² of the layer's input (~2,000 for the 4,096
# wide hidden layers, times 10 with momentum 0.9): 0.01 diverges there, 0.001 trains.
TP_RATES = {"tp-chain": 0.01, "tp-pure": 0.001}


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


def _method(name: str, tp_rates: dict[str, float] | None = None) -> tuple[Any, str]:
    """``(TrainingConfig.method, loss_type)`` of a method of the table. TargetProp trains on its
    ``"mse"`` target (one-hot labels), the loss its fused device step takes, at its rate of
    ``tp_rates`` (default ``TP_RATES``)."""
    rates = TP_RATES if tp_rates is None else tp_rates
    if name == "backprop":
        return "backprop", "cross_entropy"
    if name == "tween":
        return TweenConfig(base_rate=0.01), "cross_entropy"
    if name == "tp-chain":
        return TargetPropConfig(learning_rate=rates["tp-chain"]), "mse"
    if name == "tp-pure":
        return TargetPropConfig(mode="pure", learning_rate=rates["tp-pure"]), "mse"
    raise ValueError(f"unknown method {name!r}; one of {METHODS}")


class Rate(float):
    """Samples/s (a float) with ``skipped``: the batches the run did not count (0: every one ran)."""

    skipped: int = 0

    def __new__(cls, value: float, skipped: int = 0) -> "Rate":
        r = super().__new__(cls, value)
        r.skipped = int(skipped)
        return r


def torchloom_rate(method, sizes, batch, steps, epochs, dev, rank, distributed, graphs=True, tp_rates=None) -> Rate:
    """Samples/s of all ranks taking part (``distributed``: every rank; else this one), with the
    batches the run skipped (``Rate.skipped``; nonzero: the run diverged and the rate is no step rate)."""
    net = _torchloom_net(sizes, dev)
    data = _data(sizes, batch, steps, dev, rank)
    m, loss = _method(method, tp_rates)
    cfg = TrainingConfig(
        method=m, loss_type=loss, epochs=epochs, verbose=0, device=dev,
        track_perf=True, distributed=None if distributed else False, cuda_graph=None if graphs else False,
    )
    with warnings.catch_warnings():  # a diverged run is reported in the table (Rate.skipped), once
        warnings.simplefilter("ignore", DivergenceWarning)
        result = torchloom.train(net, data, cfg)
    rates = [p["samples_per_second"] for p in result.perf[1:]] or [result.perf[0]["samples_per_second"]]
    world = dist.get_world_size() if distributed else 1
    return Rate(max(rates) * world, result.skipped_batches)


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


def side_by_side(rounds: int, run_backprop: Any, run_ddp: Any) -> tuple[list[float], list[float]]:
    """``rounds`` alternated timings of torchloom backprop and the DDP loop: ``(backprop rates, DDP
    rates)`` per round. The order flips every round (backprop first in even rounds), so whatever
    drifts over the rounds reaches both alike. A backprop rate keeps its ``Rate.skipped``."""
    bp, ddp = [], []
    for r in range(rounds):
        if r % 2 == 0:
            bp.append(run_backprop())
            ddp.append(run_ddp())
        else:
            ddp.append(run_ddp())
            bp.append(run_backprop())
    return bp, ddp


def _best(rates: list[float]) -> float:
    """The best round; a backprop ``Rate`` keeps the most batches any round skipped."""
    best = max(rates)
    skipped = max(getattr(r, "skipped", 0) for r in rates)
    return Rate(best, skipped) if skipped or isinstance(best, Rate) else best


def _round_line(label: str, bp: list[float], ddp: list[float]) -> str:
    """One line of per-round numbers: backprop, DDP and their ratio per round, and the ratios of the
    best rounds and the medians."""
    pairs = ", ".join(f"{b:,.0f}/{d:,.0f}={b / d:.3f}" for b, d in zip(bp, ddp))
    return (
        f"  {label}: backprop/DDP per round: {pairs}; best {max(bp) / max(ddp):.3f}×, "
        f"median {statistics.median(bp) / statistics.median(ddp):.3f}×"
    )


def _selected(values: Any, chosen: str, parse: Any) -> tuple:
    """``values`` restricted to the comma-separated ``chosen`` (all when empty), parsed by ``parse``."""
    if not chosen:
        return tuple(values)
    return tuple(parse(v) for v in chosen.split(","))


def bench(args: Any, rank: int, world: int, dev: torch.device) -> list[dict[str, Any]]:
    nets = TOY_NETS if args.dry_run else _selected(NETS, args.nets, lambda v: tuple(int(n) for n in v.split("-")))
    batches = TOY_BATCHES if args.dry_run else _selected(BATCHES, args.batches, int)
    methods = _selected(METHODS, args.methods, str)
    tp_rates = dict(TP_RATES, **({"tp-pure": args.tp_pure_lr} if args.tp_pure_lr else {}))
    graphs = not args.no_graphs
    rows = []
    for sizes in nets:
        for batch in batches:
            steps = args.steps or (2 if args.dry_run else (16 if args.quick else 64) if batch <= 1024 else (8 if args.quick else 24))
            epochs = args.epochs
            name = "-".join(map(str, sizes))

            def phase(distributed: bool) -> tuple[dict[str, float], str]:
                """Every method at this setting (on this rank alone, or data-parallel): backprop and
                DDP side by side in rounds, the others once; the rounds' line for rank 0."""
                rates = {
                    m: torchloom_rate(m, sizes, batch, steps, epochs, dev, rank, distributed, graphs, tp_rates)
                    for m in methods if m != "backprop"
                }
                line = ""
                if "backprop" in methods:
                    bp, ddp = side_by_side(
                        args.rounds,
                        lambda: torchloom_rate("backprop", sizes, batch, steps, epochs, dev, rank, distributed, graphs),
                        lambda: ddp_rate(sizes, batch, steps, epochs, dev, rank, distributed),
                    )
                    rates["backprop"], rates["ddp"] = _best(bp), max(ddp)
                    gpus = f"{world} GPUs" if distributed else "1 GPU"
                    line = _round_line(f"{name} / {batch:,} on {gpus}", bp, ddp)
                else:
                    rates["ddp"] = ddp_rate(sizes, batch, steps, epochs, dev, rank, distributed)
                return rates, line

            one, one_line = {}, ""
            if rank == 0:  # one GPU: rank 0 alone, no process group traffic
                one, one_line = phase(False)
            if world > 1:
                dist.barrier()
            many, many_line = phase(world > 1)
            if rank == 0:
                for line in (one_line, many_line):
                    if line:
                        print(line, flush=True)
                for m in (*(m for m in METHODS if m in methods), "ddp"):
                    rows.append(dict(net=name, batch=batch, method=m, one=one[m], many=many[m], ddp_many=many["ddp"]))
    return rows


def table(rows: list[dict[str, Any]], world: int, device: str) -> str:
    lines = [
        f"Samples/s, {device}, per-GPU batch; N = {world} GPUs (one process each). fp32, SGD, cross-entropy (TargetProp: its mse target of the one-hot labels).",
        "",
        f"| net | batch/GPU | method | 1 GPU | {world} GPUs | scaling | vs DDP on {world} GPUs |",
        "|---|---:|---|---:|---:|---:|---:|",
    ]
    skipped = False
    for r in rows:
        name = "plain PyTorch DDP" if r["method"] == "ddp" else f"torchloom {r['method']}"
        lines.append(
            f"| {r['net']} | {r['batch']:,} | {name} | {_cell(r['one'])} | {_cell(r['many'])} | "
            f"{r['many'] / r['one']:.2f}× | {r['many'] / r['ddp_many']:.2f}× |"
        )
        skipped = skipped or any(getattr(r[k], "skipped", 0) for k in ("one", "many"))
    if skipped:
        lines += ["", "⚠ N skipped: the run skipped N batches (it diverged); its samples/s counts only the batches that ran."]
    return "\n".join(lines)


def _cell(rate: float) -> str:
    """A samples/s cell, marked ⚠ with the batches skipped when the run skipped any."""
    skipped = getattr(rate, "skipped", 0)
    return f"{rate:,.0f}" + (f" ⚠ {skipped} skipped" if skipped else "")


def _per_step_kernels(run, steps: int, top: int = 12) -> list[tuple[str, int, float]]:
    """``(kernel name, launches per step, µs per step)`` of the ``top`` kernels by device time in
    ``run()`` (which runs ``steps`` steps), from torch's profiler."""
    from torch.profiler import ProfilerActivity, profile

    cuda = torch.cuda.is_available()
    with profile(activities=[ProfilerActivity.CUDA if cuda else ProfilerActivity.CPU]) as prof:
        run()
        if cuda:
            torch.cuda.synchronize()
    time_of = (lambda e: getattr(e, "device_time_total", 0)) if cuda else (lambda e: e.self_cpu_time_total)  # noqa: E731
    events = sorted((e for e in prof.key_averages() if time_of(e) > 0), key=lambda e: -time_of(e))
    return [(e.key, round(e.count / steps), time_of(e) / steps) for e in events[:top]]


def one_gpu_profile(args: Any) -> int:
    """``--one-gpu-profile``: on one GPU, the backprop step of torchloom (the single-pass guard), of
    torchloom with the previous guard (backup copy, check after, restore: ``Backprop._can_probe``
    off) and of plain PyTorch, timed alternately (best of ``--rounds``), then the kernels of one step
    of each: what torchloom's step does on the device beyond PyTorch's."""
    from torchloom.methods.backprop import Backprop

    dev = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")  # CPU: a smoke test only
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    sizes = tuple(int(v) for v in args.net.split("-"))
    batch = args.batch
    steps = args.steps or (16 if args.quick else 64)
    probe = Backprop._can_probe
    backup = lambda self: False  # noqa: E731 - the previous guard, for the comparison only

    def rate(kind: str) -> float:
        if kind == "pytorch":
            return ddp_rate(sizes, batch, steps, args.epochs, dev, 0, False)
        Backprop._can_probe = probe if kind == "torchloom" else backup
        try:
            return torchloom_rate("backprop", sizes, batch, steps, args.epochs, dev, 0, False, not args.no_graphs)
        finally:
            Backprop._can_probe = probe

    kinds = ("torchloom", "torchloom-backup-guard", "pytorch")
    best = dict.fromkeys(kinds, 0.0)
    for _ in range(args.rounds):  # alternated, so a clock or thermal drift hits every kind alike
        for kind in kinds:
            best[kind] = max(best[kind], rate(kind))
    name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "CPU (smoke test: no timings worth reading)"
    print(f"{name}, net {args.net}, batch {batch:,}, {steps} steps/epoch, best of {args.rounds} rounds")
    print("| step | samples/s | vs PyTorch |\n|---|---:|---:|")
    for kind in kinds:
        print(f"| {kind} | {best[kind]:,.0f} | {best[kind] / best['pytorch']:.3f}× |")

    data = _data(sizes, batch, steps, dev, 0)
    for kind in ("torchloom", "torchloom-backup-guard"):
        Backprop._can_probe = probe if kind == "torchloom" else backup
        try:
            net = _torchloom_net(sizes, dev)
            cfg = TrainingConfig(method="backprop", loss_type="cross_entropy", epochs=4, verbose=0, device=dev)
            # 4 epochs, the first capturing the graphs: the warm-up steps add 2 of 4 × steps
            table_rows = _per_step_kernels(lambda: torchloom.train(net, data, cfg), 4 * steps)
        finally:
            Backprop._can_probe = probe
        print(f"\n{kind}: kernels per step (4 epochs, graph replays; top by device time)")
        for name, count, us in table_rows:
            print(f"  {us:8.1f} µs  ×{count:<3d} {name[:90]}")
    model = _torch_net(sizes, dev)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)

    def torch_epoch():
        for x, y in data:
            opt.zero_grad(set_to_none=True)
            F.cross_entropy(model(x), y).backward()
            opt.step()

    torch_epoch()
    print("\npytorch: kernels per step (top by device time)")
    for name, count, us in _per_step_kernels(torch_epoch, steps):
        print(f"  {us:8.1f} µs  ×{count:<3d} {name[:90]}")
    return 0


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
    parser.add_argument("--one-gpu-profile", action="store_true",
                        help="one GPU, no torchrun: torchloom's backprop step (and with its previous guard) vs plain PyTorch, and their kernels per step")
    parser.add_argument("--net", default="784-4096-4096-10", help="--one-gpu-profile: layer sizes")
    parser.add_argument("--batch", type=int, default=1024, help="--one-gpu-profile: batch size")
    parser.add_argument("--rounds", type=int, default=3,
                        help="alternated timing rounds: backprop vs DDP in the table, the three steps of --one-gpu-profile")
    parser.add_argument("--nets", default="", help="the table's nets only, comma-separated (e.g. 784-4096-4096-10); default all")
    parser.add_argument("--batches", default="", help="the table's per-GPU batches only, comma-separated; default all")
    parser.add_argument("--methods", default="", help=f"the table's torchloom methods only, comma-separated, of {','.join(METHODS)}; default all")
    parser.add_argument("--tp-pure-lr", type=float, default=0.0,
                        help=f"pure TargetProp's learning rate (default {TP_RATES['tp-pure']}; 0.01 diverges on the big net)")
    args = parser.parse_args(argv)
    if args.rounds < 1:
        parser.error(f"--rounds must be >= 1, got {args.rounds}")
    unknown = [m for m in args.methods.split(",") if m and m not in METHODS]
    if unknown:
        parser.error(f"--methods: unknown {unknown}; allowed: {','.join(METHODS)}")
    if args.one_gpu_profile:
        return one_gpu_profile(args)
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
