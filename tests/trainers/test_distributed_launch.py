"""Data-parallel runs as users launch them (CPU, gloo, processes on 127.0.0.1), each bounded in time:

* ``torchrun --nnodes=2 --nproc-per-node=1`` with the c10d rendezvous (two "machines", one process
  each) trains every method as one process does on the global batches; after these ``train()``
  calls and one of a ``DistributedDataParallel``-wrapped model, with ``destroy_process_group`` never
  called, every process exits within seconds of its last epoch;
* a rank that raises (and so ends): the other rank gets an error within the process group's
  timeout and every process exits, none hangs (started without torchrun, whose agent would otherwise
  stop the others itself).
"""

from __future__ import annotations

import os
import subprocess
import sys
import time

import numpy as np
import pytest
import torch

from torchloom import train
from helpers import free_port

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import _two_nodes_worker as worker  # noqa: E402

pytestmark = pytest.mark.skipif(not torch.distributed.is_available(), reason="torch.distributed is not available")


def _env() -> dict[str, str]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)}
    env["OMP_NUM_THREADS"] = "1"
    return env


def test_two_nodes_c10d_rendezvous_equals_one_process(tmp_path):
    port = free_port()
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes=2", "--nproc-per-node=1", "--rdzv-backend=c10d",
           f"--rdzv-endpoint=127.0.0.1:{port}", "--rdzv-id=two-nodes-test", os.path.join(HERE, "_two_nodes_worker.py"), str(tmp_path)]
    logs = [open(tmp_path / f"out{i}.txt", "w+") for i in range(2)]  # noqa: SIM115 - closed below
    nodes = [subprocess.Popen(cmd, env=_env(), cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, text=True) for log in logs]
    ended: dict[int, float] = {}
    # The bound on the whole launch only keeps a hang from stalling the suite: alone it takes ~10 s, six
    # at once on 8 cores ~45 s, and a slow CI runner more. The property tested is the exit within 10 s
    # of each node's last epoch (below), measured from that epoch, not from the launch.
    deadline = time.monotonic() + 240
    try:
        while len(ended) < 2 and time.monotonic() < deadline:
            for i, p in enumerate(nodes):
                if i not in ended and p.poll() is not None:
                    ended[i] = time.time()
            time.sleep(0.05)
    finally:
        for p in nodes:
            if p.poll() is None:
                p.kill()
    outputs = []
    for log in logs:
        log.seek(0)
        outputs.append(log.read())
        log.close()
    for i, (p, text) in enumerate(zip(nodes, outputs)):
        assert i in ended, f"node {i} did not end within 240 s of the launch:\n{text[-3000:]}"
        assert p.returncode == 0, text[-3000:]
        last = [float(line.split()[1]) for line in text.splitlines() if line.startswith("LAST_EPOCH")]
        assert len(last) == 1, text[-3000:]
        assert ended[i] - last[0] < 10, f"node {i} exited {ended[i] - last[0]:.1f} s after its last epoch"
    results = [torch.load(tmp_path / f"node{r}.pt", weights_only=False) for r in range(2)]
    assert sorted(r["group_rank"] for r in results) == [0, 1]  # two "nodes" of one process each
    assert all(r["world"] == 2 and r["local_world"] == 1 for r in results)
    for name in worker.METHODS:
        ref = worker.net()
        expected = train(ref, worker.data(), worker.config(name, distributed=False))
        for res in results:
            weights, losses = res[name]
            np.testing.assert_allclose(losses, expected.loss_history, rtol=1e-10, atol=1e-10)
            for p, q in zip(weights, ref.parameters()):
                torch.testing.assert_close(p, q.detach(), rtol=1e-10, atol=1e-10)
    ref = worker.net()
    train(ref, worker.data(), worker.config("backprop", distributed=False))
    for res in results:  # the DDP wrapper's module, trained by the engine
        for p, q in zip(res["ddp"], ref.parameters()):
            torch.testing.assert_close(p, q.detach(), rtol=1e-10, atol=1e-10)


def _exit_check(*args: str, timeout: float = 90) -> str:
    proc = subprocess.run(
        [sys.executable, os.path.join(ROOT, "bench", "exit_check.py"), "--cpu", "--short", "--steps", "2", "--epochs", "2", *args],
        env=_env(), cwd=ROOT, capture_output=True, text=True, timeout=timeout,
    )
    assert proc.returncode == 0 and "EXIT_CHECK OK" in proc.stdout, proc.stdout[-4000:] + proc.stderr[-2000:]
    return proc.stdout


def test_a_failing_rank_ends_every_process_within_the_timeout():
    out = _exit_check("--launcher", "direct", "--fail-rank", "1", "--pg-timeout", "10", "--limit", "10", "--timeout", "60")
    assert "rank 1's error → every rank exited:" in out
