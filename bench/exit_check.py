"""Does a data-parallel run exit promptly? The benchmark's sequence of ``train()`` calls, then the time
from each rank's last epoch to its process's exit.

On 2 GPUs (NCCL; the machine needs no network, run from the repository root):

    PYTHONPATH=. python bench/exit_check.py --nproc 2                     # under torchrun, destroy_process_group called
    PYTHONPATH=. python bench/exit_check.py --nproc 2 --no-destroy        # the script never calls it
    PYTHONPATH=. python bench/exit_check.py --nproc 2 --short --fail-rank 1 --pg-timeout 120   # rank 1 raises in its 2nd epoch

On CPU (gloo, toy sizes; what the tests run): add ``--cpu``. ``--launcher direct`` starts the ranks as
plain processes (no torchrun agent, which would otherwise kill the other ranks when one fails: the
stricter test of a failing rank).

The ranks (``--worker``, started by this script) run ``bench/bench_distributed.py``'s sequence: for
each network and batch, rank 0 alone trains every method with ``distributed=False`` and a plain
PyTorch loop, then every rank trains every method data-parallel (CUDA graphs with the all-reduce
captured, on GPUs) and a ``DistributedDataParallel`` loop. A rank prints ``LAST_EPOCH <time>`` when
its last ``train()`` call has returned. This script prints, per rank, the seconds from that line to
the process's exit and its exit code, and exits 0 when every rank exited within ``--limit`` seconds
(10) of its last epoch with code 0; with ``--fail-rank R``, when rank R reported its error, every rank
exited non-zero, and all within the process group's timeout (``--pg-timeout``) plus ``--limit``
seconds of rank R's error. A rank still running after ``--timeout`` seconds is killed and reported
as hung.
"""

from __future__ import annotations

import argparse
import datetime
import os
import re
import socket
import subprocess
import sys
import time
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


# ------------------------------------------------------------------------------------ the ranks
def worker(args: Any) -> int:
    import torch
    import torch.distributed as dist

    sys.path.insert(0, HERE)
    import bench_distributed as bd

    import torchloom

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    use_cuda = torch.cuda.is_available() and not args.cpu
    if use_cuda:
        dev = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(dev)
    else:
        dev = torch.device("cpu")
        torch.set_num_threads(1)
    dist.init_process_group("nccl" if use_cuda else "gloo", timeout=datetime.timedelta(seconds=args.pg_timeout))
    bench_args = argparse.Namespace(dry_run=not use_cuda, quick=True, steps=args.steps, epochs=args.epochs, no_graphs=False)
    if args.short:  # the first network and batch size only
        bd.NETS, bd.TOY_NETS, bd.BATCHES, bd.TOY_BATCHES = bd.NETS[:1], bd.TOY_NETS[:1], bd.BATCHES[:1], bd.TOY_BATCHES[:1]
    if args.fail_rank is not None and rank == args.fail_rank:  # its observer joins every distributed train() call
        from torchloom.observers.base import Observer

        class FailOnEpoch(Observer):
            """Raises at the end of the 2nd epoch of the first data-parallel ``train()`` call."""

            calls = 0

            def on_train_begin(self, trainer: Any) -> None:
                self.calls += 1

            def on_epoch_end(self, trainer: Any, epoch: int, logs: Any) -> None:
                if self.calls == 1 and epoch == 1:
                    raise RuntimeError(f"exit_check: rank {rank} fails on purpose in epoch {epoch + 1}")

        fail = FailOnEpoch()
        plain = torchloom.TrainingConfig

        def failing(**kw: Any) -> Any:
            if kw.get("distributed", None) is not False:
                kw["observers"] = [*kw.get("observers", ()), fail]
            return plain(**kw)

        bd.TrainingConfig = failing  # this process's copy of the benchmark only
    try:
        bd.bench(bench_args, rank, world, dev)
    except Exception as e:
        print(f"RANK_ERROR {rank} {time.time():.6f} {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}", flush=True)
        raise
    print(f"LAST_EPOCH {rank} {time.time():.6f}", flush=True)
    if not args.no_destroy:
        dist.barrier()
        dist.destroy_process_group()
        print(f"DESTROYED {rank} {time.time():.6f}", flush=True)
    return 0


# ---------------------------------------------------------------------------------- the launcher
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker_argv(args: Any) -> list[str]:
    argv = [os.path.abspath(__file__), "--worker", "--steps", str(args.steps), "--epochs", str(args.epochs),
            "--pg-timeout", str(args.pg_timeout)]
    if args.cpu:
        argv.append("--cpu")
    if args.short:
        argv.append("--short")
    if args.no_destroy:
        argv.append("--no-destroy")
    if args.fail_rank is not None:
        argv += ["--fail-rank", str(args.fail_rank)]
    return argv


def launch(args: Any) -> int:
    """Start the ranks, wait (at most ``--timeout`` s), report; returns the exit code."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)}
    env.setdefault("OMP_NUM_THREADS", "1")
    port = _free_port()
    logs = []
    procs: list[subprocess.Popen] = []
    if args.launcher == "torchrun":
        cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={args.nproc}", "--nnodes=1",
               f"--master-port={port}", "--master-addr=127.0.0.1", *_worker_argv(args)]
        procs.append(subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT))
    else:
        for r in range(args.nproc):
            renv = {**env, "RANK": str(r), "LOCAL_RANK": str(r), "WORLD_SIZE": str(args.nproc), "LOCAL_WORLD_SIZE": str(args.nproc),
                    "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
            procs.append(subprocess.Popen([sys.executable, *_worker_argv(args)], env=renv, stdout=subprocess.PIPE,
                                          stderr=subprocess.STDOUT, text=True, cwd=ROOT))
    import threading

    ended: dict[int, float] = {}
    outputs: dict[int, list[str]] = {i: [] for i in range(len(procs))}

    def read(i: int, p: subprocess.Popen) -> None:
        for line in p.stdout:  # type: ignore[union-attr]
            outputs[i].append(line)
        p.wait()
        ended[i] = time.time()

    readers = [threading.Thread(target=read, args=(i, p), daemon=True) for i, p in enumerate(procs)]
    for t in readers:
        t.start()
    deadline = time.monotonic() + args.timeout
    for t in readers:
        t.join(max(deadline - time.monotonic(), 0.0))
    hung = [i for i, p in enumerate(procs) if p.poll() is None]
    for i in hung:
        procs[i].kill()
    for t in readers:
        t.join(5)
    text = "".join(line for i in range(len(procs)) for line in outputs[i])
    logs.append(text)
    last, errors = {}, {}
    # under torchrun the ranks share one pipe: their lines can run into each other ("…382798LAST_EPOCH 1 …")
    for kind, rank, stamp in re.findall(r"(LAST_EPOCH|RANK_ERROR) (\d+) (\d+(?:\.\d+)?)", text):
        (last if kind == "LAST_EPOCH" else errors)[int(rank)] = float(stamp)
    codes = [p.returncode for p in procs]
    exit_time = max(ended.values()) if ended and not hung else None
    print(f"launcher: {args.launcher}, {args.nproc} ranks, {'CPU gloo' if args.cpu else 'NCCL if CUDA'}, "
          f"destroy_process_group {'not called' if args.no_destroy else 'called'}"
          + (f", rank {args.fail_rank} fails" if args.fail_rank is not None else ""))
    ok = not hung
    if args.fail_rank is None:
        for r in range(args.nproc):
            if r not in last:
                print(f"rank {r}: no LAST_EPOCH line (it failed or hung)")
                ok = False
                continue
            end = ended.get(r if args.launcher == "direct" else 0)
            took = None if end is None else end - last[r]
            print(f"rank {r}: last epoch → exit: {'HUNG' if took is None else f'{took:.2f} s'}")
            ok = ok and took is not None and took <= args.limit
        ok = ok and all(c == 0 for c in codes)
    else:
        if args.fail_rank not in errors:
            print(f"rank {args.fail_rank}: never reported its error")
            ok = False
        else:
            took = None if exit_time is None else exit_time - errors[args.fail_rank]
            print(f"rank {args.fail_rank}'s error → every rank exited: {'HUNG' if took is None else f'{took:.2f} s'}")
            ok = ok and took is not None and took <= args.pg_timeout + args.limit
        ok = ok and all(c != 0 for c in codes)
    print(f"exit codes: {codes}{'; hung (killed): ' + str(hung) if hung else ''}")
    print("EXIT_CHECK", "OK" if ok else "FAILED", flush=True)
    if not ok or args.verbose:
        print("---- output of the ranks ----\n" + text[-6000:])
    return 0 if ok else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--cpu", action="store_true", help="gloo on CPU processes, toy sizes")
    parser.add_argument("--launcher", choices=("torchrun", "direct"), default="torchrun")
    parser.add_argument("--short", action="store_true", help="the first network and batch size of the benchmark only")
    parser.add_argument("--no-destroy", action="store_true", help="the ranks never call destroy_process_group")
    parser.add_argument("--fail-rank", type=int, default=None, help="this rank raises in its first data-parallel train() call")
    parser.add_argument("--steps", type=int, default=4, help="steps per epoch of every train() call")
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--pg-timeout", type=float, default=600.0,
                        help="the process group's timeout, seconds (the other ranks wait at a barrier while rank 0 runs the 1-GPU part)")
    parser.add_argument("--limit", type=float, default=10.0, help="seconds allowed from the last epoch to the exit")
    parser.add_argument("--timeout", type=float, default=300.0, help="kill the ranks after this many seconds")
    parser.add_argument("--verbose", action="store_true", help="print the ranks' output")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        return worker(args)
    return launch(args)


if __name__ == "__main__":
    sys.exit(main())
